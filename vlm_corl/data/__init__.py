"""Data: loaders, records, images, paraphrases, the sampler, answer extraction and equivalence."""
