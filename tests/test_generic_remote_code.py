"""A checkpoint that ships its own modelling code (config.json `auto_map`, issue 46): with the member's
`trust_remote_code: true` the generic family loads it through the Auto classes and it trains in a cohort; without it
the load is refused, naming `trust_remote_code` and what setting it risks (the default stays off). The planner
counts such a checkpoint from its weight files without running its code."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from cohort_helpers import cohort, metrics, weights

from vlm_corl import CohortTrainer
from vlm_corl.config.schema import MemberConfig
from vlm_corl.data.records import Example
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.members.families.qwen import CHATML_TOKENS, chatml_template
from vlm_corl.members.families.tokenizer import build_tokenizer
from vlm_corl.members.member import MemberLoadError, load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams

# The checkpoint's own code: a config and a causal LM of a model type transformers does not know.
MODELLING = textwrap.dedent(
    '''
    """A custom decoder: Llama's layers under a model type of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM


    class RemoteConfig(LlamaConfig):
        model_type = "corl_remote_lm"


    class RemoteForCausalLM(LlamaForCausalLM):
        config_class = RemoteConfig
    '''
)


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory) -> Path:
    """A tiny checkpoint whose config.json points `auto_map` at modelling_remote.py beside it."""
    path = tmp_path_factory.mktemp("remote")
    (path / "modelling_remote.py").write_text(MODELLING)
    tokenizer = build_tokenizer(
        list(CHATML_TOKENS.tokens),
        bos=None,
        eos="<|im_end|>",
        pad=CHATML_TOKENS.pad,
        chat_template=chatml_template(None),
    )
    config = {
        "model_type": "corl_remote_lm",
        "auto_map": {
            "AutoConfig": "modelling_remote.RemoteConfig",
            "AutoModelForCausalLM": "modelling_remote.RemoteForCausalLM",
        },
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    loaded = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = transformers.AutoModelForCausalLM.from_config(loaded, trust_remote_code=True)
    assert type(model).__name__ == "RemoteForCausalLM"  # the checkpoint's class, not one of transformers'
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert "auto_map" in json.loads((path / "config.json").read_text())
    return path


def test_without_trust_remote_code_the_member_is_refused_naming_the_setting_and_its_risk(remote_model):
    """The default: the checkpoint's code never runs, and the refusal says how to allow it and what that means."""
    with pytest.raises(MemberLoadError) as refused:
        load_member(MemberConfig(id="r", model=str(remote_model), trainable=False))
    message = str(refused.value)
    assert "member 'r'" in message and "members[i].trust_remote_code: true" in message
    assert "executes the checkpoint's Python files" in message and "newer transformers" not in message


def test_with_trust_remote_code_the_generic_family_loads_and_samples_it(remote_model):
    member = load_member(MemberConfig(id="r", model=str(remote_model), trainable=False, trust_remote_code=True))
    assert (member.family.name, member.family.modality) == ("generic", "text")
    assert type(member.model).__name__ == "RemoteForCausalLM"
    assert member.eos_token_ids[0] == member.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = Renderer(member, "original", 1 << 20, 1 << 14)(Example("a", "2+2?"))
    torch.manual_seed(0)
    (group,) = HFEngine(member).generate([prompt], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
    assert [0 < len(r.token_ids) <= 4 for r in group.responses] == [True, True]


def test_a_trusted_remote_code_member_trains_two_steps_in_a_cohort(remote_model, tiny_zoo, tmp_path):
    """Beside a registered member; the memory check plans it without running its code; its weights move."""
    cfg = cohort(
        tmp_path,
        [("r", remote_model), ("peer", tiny_zoo["qwen3"])],
        data={"train": {"loader": "math500", "split": "test", "limit": 8}, "batch_size": 2},
        rollout={"n": 2, "max_new_tokens": 6},
        reward={"mode": "entropy"},  # every response rewarded apart: a gradient each step
    )
    cfg["members"][0]["trust_remote_code"] = True
    cfg["train"].update(save_every=2, lr=1e-2)
    CohortTrainer(cfg).train()
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [
        (s, m) for s in (1, 2) for m in ("peer", "r")
    ]
    trained = weights(tmp_path / "run" / "checkpoints" / "step-2" / "r")
    assert any(not torch.equal(trained[k], v) for k, v in weights(remote_model).items())


def test_the_planner_counts_a_remote_code_checkpoint_from_its_weight_files(remote_model):
    from vlm_corl.planning.shapes import model_shape

    shape = model_shape(str(remote_model))
    stored = weights(remote_model)
    assert shape.params == sum(t.numel() for t in stored.values())
    assert shape.largest_tensor == max(t.numel() for t in stored.values())
    assert (shape.hidden, shape.layers, shape.intermediate, shape.kv_heads, shape.head_dim) == (64, 2, 128, 2, 16)
