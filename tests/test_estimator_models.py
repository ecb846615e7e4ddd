"""Any transformers decoder: parameter counts against the model transformers builds (meta
device), the registry against published counts, one clear line for a bad config, the traced
estimate for every configuration the analytical one accepts, and the two agreeing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotune.errors import UserError
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import MODELS, count_params, resolve_model, stats_of, validate_config
from tests.conftest import cli

SMALL = {"vocab_size": 1000, "num_hidden_layers": 2, "num_attention_heads": 4, "use_cache": False}
#: a tiny config of each family the issue names (and their quirks: GQA, biases, q/k norms,
#: tied embeddings, fused projections, GPT-2's own key names, MoE)
FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama", **SMALL, "hidden_size": 128, "intermediate_size": 344,
              "num_key_value_heads": 2},
    "mistral": {"model_type": "mistral", **SMALL, "hidden_size": 128, "intermediate_size": 344,
                "num_key_value_heads": 2},
    "qwen2": {"model_type": "qwen2", **SMALL, "hidden_size": 128, "intermediate_size": 344,
              "num_key_value_heads": 2},
    "qwen3": {"model_type": "qwen3", **SMALL, "hidden_size": 128, "intermediate_size": 344,
              "num_key_value_heads": 2, "head_dim": 32},
    "gemma2": {"model_type": "gemma2", **SMALL, "hidden_size": 128, "intermediate_size": 344,
               "num_key_value_heads": 2, "head_dim": 32},
    "phi3": {"model_type": "phi3", **SMALL, "hidden_size": 128, "intermediate_size": 344,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 128, "n_layer": 2, "n_head": 4,
             "use_cache": False},
    "gpt_neox": {"model_type": "gpt_neox", **SMALL, "hidden_size": 128,
                 "intermediate_size": 512},
    "mixtral": {"model_type": "mixtral", **SMALL, "hidden_size": 128, "intermediate_size": 344,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
}  # fmt: skip


def _transformers_count(cfg: dict) -> int:
    """The oracle: the model transformers itself builds, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = dict(cfg)
    config = AutoConfig.for_model(args.pop("model_type"), **args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_count_equals_the_transformers_model(family: str) -> None:
    assert count_params(FAMILIES[family]) == _transformers_count(FAMILIES[family])


#: published parameter counts (model cards / the papers), to 3 significant digits or better
PUBLISHED = {
    "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-2-70b": 69.0e9, "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9, "mistral-7b": 7.24e9, "qwen2.5-7b": 7.61e9, "mixtral-8x7b": 46.7e9,
    "gemma-2-9b": 9.24e9, "gpt2-xl": 1.56e9, "qwen3-8b": 8.19e9, "phi-3-mini": 3.82e9,
    "pythia-6.9b": 6.86e9,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_registry_matches_published_counts(name: str) -> None:
    assert MODELS[name].n_params == pytest.approx(PUBLISHED[name], rel=0.005)


def test_mixtral_active_parameters_are_the_published_12_9b() -> None:
    from autotune.models import stats_of

    assert stats_of(MODELS["mixtral-8x7b"].config).active_params == pytest.approx(12.9e9, rel=0.005)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({**FAMILIES["llama"], "hidden_size": -128}, "hidden_size must be a positive integer"),
        ({**FAMILIES["llama"], "num_hidden_layers": 0}, "num_hidden_layers must be a positive"),
        ({k: v for k, v in FAMILIES["llama"].items() if k != "vocab_size"}, "missing vocab_size"),
        ({k: v for k, v in FAMILIES["gpt2"].items() if k != "n_embd"}, "missing hidden_size"),
        ({**FAMILIES["llama"], "model_type": "lama"}, "not a causal LM transformers can build"),
        ({**FAMILIES["llama"], "model_type": "vit"}, "not a causal LM"),
        ({**FAMILIES["llama"], "intermediate_size": "big"}, "intermediate_size must be"),
    ],
)
def test_bad_model_configs_get_one_clear_line(cfg: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        validate_config(cfg, "m.json")
    assert "\n" not in str(info.value)


def test_cli_bad_model_config_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "neg.json"
    path.write_text(json.dumps({**FAMILIES["llama"], "hidden_size": -1}))
    result = cli("estimate", "--model", str(path), "--budget", "24GB")
    assert result.exit_code == 2
    assert "hidden_size must be a positive integer" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_gpt2_config_json_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({**MODELS["gpt2-xl"].config, "architectures": ["GPT2LMHeadModel"]}))
    entry = resolve_model(str(path))
    assert entry.n_params == MODELS["gpt2-xl"].n_params


KW = {"seq_len_tokens": 64, "global_batch_sequences": 8}
BASE = {"gradient_checkpointing": "off", "attention": "sdpa", "optimizer": "adamw",
        "micro_batch_size": 4}  # fmt: skip
#: every kind of configuration the analytical estimator accepts
CONFIGS = [
    {"precision": "fp32"},
    {"precision": "bf16", "zero_stage": 1},
    {"precision": "bf16", "zero_stage": 2, "offload_optimizer": "cpu"},
    {"precision": "bf16", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    {"precision": "bf16", "gradient_checkpointing": "full", "zero_stage": 3},
    {"precision": "bf16", "quantization": "nf4"},
    {"precision": "fp32", "attention": "eager", "zero_stage": 2},
]


#: ZeRO's buckets small enough that DeepSpeed's defaults (500M elements: 1 GB in 16 bits, counted
#: in full as DeepSpeed allocates them) do not hide the rest of these small models' peaks
BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000}


def _both(cfg: dict, config: dict, tmp_path: Path) -> tuple[int, int]:
    c = {**BASE, **BUCKETS, **config}
    traced = TracedEstimator(cache=tmp_path).estimate(Workload(cfg, **KW), c).peak_bytes
    return traced, AnalyticalEstimator().estimate(Workload(cfg, **KW), c).peak_bytes


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_traced_runs_every_config_and_agrees_within_10_percent(
    family: str, config: dict, tmp_path: Path
) -> None:
    traced, analytical = _both(FAMILIES[family], config, tmp_path)
    assert analytical == pytest.approx(traced, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("config", CONFIGS[:5], ids=lambda c: "-".join(map(str, c.values())))
def test_other_families_trace_and_agree(family: str, config: dict, tmp_path: Path) -> None:
    traced, analytical = _both(FAMILIES[family], config, tmp_path)
    assert analytical == pytest.approx(traced, rel=0.10)


def test_traced_notes_say_what_came_from_the_formula(tmp_path: Path) -> None:
    config = {**BASE, "precision": "bf16", "zero_stage": 3, "offload_optimizer": "cpu"}
    est = TracedEstimator(cache=tmp_path).estimate(Workload(FAMILIES["mixtral"], **KW), config)
    notes = " ".join(est.notes)
    assert "by formula" in notes and "balanced" in notes
    assert est.host_bytes > 0


def test_cli_estimate_llama7b_with_a_zero_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's traceback (``Couldn't swap Embedding.weight``) under fake tensors."""
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "precision: bf16\nmicro_batch_size: 1\ngradient_checkpointing: full\nzero_stage: 2\n"
        "offload_optimizer: cpu\nattention: sdpa\noptimizer: adamw\n"
    )
    result = cli("estimate", "--model", "llama-7b", "--budget", "24GB", "--config", str(cfg))
    assert result.exit_code == 0, result.output
    assert "traced" in result.output and "host memory" in result.output


def test_gemma2_traces_with_eager_where_transformers_refuses_sdpa(tmp_path: Path) -> None:
    est = TracedEstimator(cache=tmp_path).estimate(
        Workload(FAMILIES["gemma2"], **KW), {**BASE, "precision": "bf16"}
    )
    assert est.peak_bytes > 0
    assert any("traced with eager attention" in note for note in est.notes)


#: each family's layer as its transformers modeling code writes it (read by hand): the norms'
#: kind and count, a parallel residual, q/k norms, capped scores, projections making q/k/v and
#: reading the MLP's input, rotary embeddings, eager attention's softmax in fp32
LAYOUTS = {
    "llama": ("rms", 2, False, False, False, 3, 2, True, True),
    "mistral": ("rms", 2, False, False, False, 3, 2, True, True),
    "qwen2": ("rms", 2, False, False, False, 3, 2, True, True),
    "qwen3": ("rms", 2, False, True, False, 3, 2, True, True),
    "gemma2": ("rms_fp32", 4, False, False, True, 3, 2, True, True),
    "phi3": ("rms", 2, False, False, False, 1, 1, True, True),
    "gpt2": ("layer", 2, False, False, False, 1, 1, False, False),
    "gpt_neox": ("layer", 2, True, False, False, 1, 1, True, True),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_layer_layout_read_off_the_model(family: str) -> None:
    st = stats_of(FAMILIES[family])
    read = (st.norm, st.norms, st.shared_norm_input, st.qk_norm, st.attn_softcap)
    read += (st.qkv_projections, st.mlp_in_projections, st.rotary, st.softmax_fp32)
    assert read == LAYOUTS[family]
