"""What a run records and watches: each member's metrics (`metrics`, per category, speed: `throughput`), the
trackers, samples.jsonl, and the collapse detector that reads them. May import `rewards` (the batch it measures);
not the phases or a run's life (the guards that act on what is watched are in `run`)."""
