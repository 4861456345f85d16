"""The memory estimate: parameter counts against real HF models, the KV cache against a real cache, the
sharding and time-sharing rules, and ``hybridrl plan`` printing the table (and warning) for Qwen2.5-7B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.cli import main
from hybridrl.config import TinyModelConfig, load_config
from hybridrl.placement.memory import (
    GIB,
    estimate_memory,
    model_shape,
    read_hf_config,
    shape_from_hf_config,
    tiny_shape,
)
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry

ROOT = Path(__file__).resolve().parents[2]
COLOCATED = ROOT / "examples" / "qwen7b-colocated.yaml"
SPLIT = ROOT / "examples" / "qwen7b-split.yaml"
QWEN7B = ROOT / "examples" / "configs" / "qwen2.5-7b"


def real_count(config) -> int:
    """Parameters of the actual transformers model (built on the meta device: no memory, no time)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def small_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=101, hidden_size=48, intermediate_size=136, num_hidden_layers=3, num_attention_heads=6)
    return {
        "qwen2-untied-gqa": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False),
        "qwen2-tied-mha": Qwen2Config(**common, num_key_value_heads=6, tie_word_embeddings=True),
        "llama-biases": LlamaConfig(**common, num_key_value_heads=3, attention_bias=True, mlp_bias=True),
        "llama-plain-tied": LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True),
        "mistral": MistralConfig(**common, num_key_value_heads=2),
        "qwen3-own-head-dim": Qwen3Config(**common, num_key_value_heads=2, head_dim=12),
    }


@pytest.mark.parametrize("name", list(small_configs()))
def test_param_count_matches_the_real_model(name, tmp_path):
    config = small_configs()[name]
    config.save_pretrained(tmp_path)  # the saved file leaves out keys equal to the defaults
    shape = shape_from_hf_config(read_hf_config(tmp_path))
    assert shape.param_count() == real_count(config)


def test_param_count_of_the_bundled_tiny_model(tmp_path):
    from hybridrl.model.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    folder = build_tiny_model(cfg, tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tiny_shape(cfg).param_count() == sum(p.numel() for p in model.parameters())


def test_qwen25_7b_count_is_the_published_one():
    from transformers import AutoConfig

    shape = shape_from_hf_config(read_hf_config(QWEN7B))
    n = shape.param_count()
    assert n == real_count(AutoConfig.from_pretrained(QWEN7B))
    assert abs(n - 7.61e9) / 7.61e9 < 0.005  # the model card: 7.61B
    assert (shape.hidden_size, shape.num_layers, shape.num_kv_heads, shape.tie_word_embeddings) == (3584, 28, 4, False)


def test_kv_bytes_per_token_match_a_real_cache():
    from transformers import Qwen2ForCausalLM

    config = small_configs()["qwen2-untied-gqa"]
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    batch, length = 3, 7
    with torch.no_grad():
        cache = model(torch.randint(0, config.vocab_size, (batch, length)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == batch * length * shape_from_hf_config(config.to_dict()).kv_bytes_per_token(2)


def test_unknown_mixture_of_experts_is_refused_with_a_reason():
    from hybridrl.placement.memory import MemoryEstimateError

    with pytest.raises(MemoryEstimateError, match="mixture-of-experts"):
        shape_from_hf_config({"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 8,
                              "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10,
                              "intermediate_size": 8})


def _estimate(path: Path, overrides: list[str] = (), devices: int = 8, memory_gib: float = 80.0, check: bool = True):
    cfg = load_config(path, list(overrides))
    registry = get_registry()
    backends, problems = resolve_backends(cfg, registry, check_engines=check)
    assert not problems
    plan = plan_placement(cfg, ClusterSpec(1, devices, "cuda", declared=True), backends)
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    return cfg, shape, estimate_memory(cfg, plan, shape, memory_gib * GIB)


def test_fsdp_states_are_sharded_over_the_pool():
    _, shape, colocated = _estimate(COLOCATED)  # actor on 8 devices
    _, _, split = _estimate(SPLIT)  # actor on 4
    n = shape.param_count()
    for est, dp in ((colocated, 8), (split, 4)):
        actor = next(m for m in est.roles if m.role == "actor")
        ref = next(m for m in est.roles if m.role == "ref")
        assert actor.grads == pytest.approx(4 * n / dp)  # fp32 gradients
        assert actor.optimizer == pytest.approx(8 * n / dp)  # two fp32 AdamW states
        assert ref.grads == ref.optimizer == 0
        assert ref.idle == pytest.approx(2 * n / dp)  # a frozen role keeps its shard in bf16 on a GPU
        rollout = next(m for m in est.roles if m.role == "rollout")
        assert rollout.weights == pytest.approx(2 * n)  # full bf16 weights, no tensor parallel


def test_colocated_peak_is_the_largest_phase_not_the_sum():
    _, _, est = _estimate(COLOCATED)
    (pool,) = est.pools
    roles = {m.role: m for m in est.roles}
    context = 1.0 * GIB
    expected = roles["actor"].idle + roles["ref"].idle + roles["rollout"].active + context
    assert pool.phases["gen"] == pytest.approx(expected)
    assert roles["rollout"].asleep == 0  # the transformers rollout frees its cache after each generation
    assert pool.phases["update_actor"] == pytest.approx(roles["actor"].active + roles["ref"].idle + context)
    assert pool.peak == max(pool.phases.values())
    assert pool.peak < sum(m.active for m in roles.values())


def test_preallocating_rollout_claims_its_share_of_the_device():
    vllm_memory = pytest.importorskip("hybridrl_vllm.memory").VLLM_MEMORY  # the plugin's model, engine-free

    overrides = ["roles.rollout.backend=vllm", "roles.rollout.options={gpu_memory_utilization: 0.5}"]
    _, shape, est = _estimate(SPLIT, overrides, check=False)
    rollout = next(m for m in est.roles if m.role == "rollout")
    profiled, graphs = vllm_memory.overhead_bytes(shape, 2, {}, 80 * GIB)  # what vLLM profiles at start
    assert rollout.graphs == graphs > 0
    # vLLM's rule: the share of the device, less the weights, the profiled activations and the graphs
    assert rollout.kv_cache == pytest.approx(40 * GIB - rollout.weights - profiled - graphs)


def test_auto_rollout_sizes_its_cache_to_the_step():
    overrides = ["roles.rollout.backend=vllm"]
    cfg, shape, est = _estimate(SPLIT, overrides, check=False)
    rollout = next(m for m in est.roles if m.role == "rollout")
    sequences = cfg.data.prompts_per_step * cfg.algorithm.n_samples // 4  # the rollout pool: 4 replicas
    tokens = cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens
    floor = sequences * tokens * shape.kv_bytes_per_token(2)
    assert floor < rollout.kv_cache <= 1.2 * floor


def test_tensor_parallel_divides_rollout_weights():
    _, shape, est = _estimate(SPLIT, ["roles.rollout.tensor_parallel=2"])
    rollout = next(m for m in est.roles if m.role == "rollout")
    assert rollout.weights == pytest.approx(shape.param_count() * 2 / 2)


def run_plan(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("config", [COLOCATED, SPLIT])
def test_plan_prints_the_memory_table_for_both_layouts(config, capsys):
    out = run_plan(capsys, str(config), "--cluster", "1x8")
    assert "memory per device (GiB; qwen2 7.62B parameters" in out
    assert "80 GiB per device" in out
    for role in ("actor", "ref", "rollout"):
        assert any(line.split()[1:2] == [role] for line in out.splitlines() if line.startswith("  "))
    assert "a device's peak is its largest phase, not the sum of its roles" in out
    assert out.count("  ok") == (1 if config == COLOCATED else 2)
    assert "WARNING" not in out


def test_plan_warns_when_the_actor_sits_on_one_gpu(capsys):
    out = run_plan(capsys, str(COLOCATED), "pools.main.devices_per_node=1", "--cluster", "1x8")
    assert "DOES NOT FIT" in out
    warning = next(line for line in out.splitlines() if line.startswith("WARNING"))
    assert "pool 'main'" in warning and "more than the 80 GiB device" in warning


def test_device_memory_flag_and_model_config_flag(capsys, tmp_path):
    out = run_plan(capsys, str(SPLIT), "--cluster", "1x8", "--device-memory", "24")
    assert "24 GiB per device" in out and "WARNING" in out
    quick = ROOT / "examples" / "quickstart.yaml"
    out = run_plan(capsys, str(quick), "--cluster", "1x1", "--model-config", str(QWEN7B / "config.json"))
    assert "7.62B parameters" in out
    config_only = tmp_path / "m"
    config_only.mkdir()
    (config_only / "config.json").write_text((QWEN7B / "config.json").read_text())
    out = run_plan(capsys, str(COLOCATED), f"model.path={config_only}", "--cluster", "1x8")
    assert f"from {config_only / 'config.json'}" in out


def test_plan_without_a_model_config_says_why(capsys, tmp_path):
    out = run_plan(capsys, str(COLOCATED), f"model.path={tmp_path}", "--cluster", "1x8")
    assert "memory estimate: skipped" in out and "--model-config" in out


def test_a_plan_on_this_machines_gpus_checks_against_their_memory(monkeypatch):
    """``hybridrl plan`` and the advisor check a detected cluster against its GPUs' own memory, as the run does
    (a 141 GiB card is not planned as 80); a declared size wins; a declared cluster gets the 80 GiB default."""
    from hybridrl.placement import memory

    monkeypatch.setattr(memory, "local_device_memory_bytes", lambda: 141 * memory.GIB)
    assert memory.planned_device_memory_bytes("cuda", None, local=True) == 141 * memory.GIB
    assert memory.planned_device_memory_bytes("cuda", 40, local=True) == 40 * memory.GIB
    assert memory.planned_device_memory_bytes("cuda", None, local=False) == memory.DEFAULT_CUDA_MEMORY_GIB * memory.GIB
    assert memory.planned_device_memory_bytes("cpu", None, local=True) is None
    monkeypatch.setattr(memory, "local_device_memory_bytes", lambda: None)  # no GPU answered: the default
    assert memory.planned_device_memory_bytes("cuda", None, local=True) == memory.DEFAULT_CUDA_MEMORY_GIB * memory.GIB
