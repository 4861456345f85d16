"""The device-map advisor (``hybridrl.placement.advice``): the cost model's fit, the ranking, the refusals and
``hybridrl plan --advise``. CPU only: the profiles are recorded (``tests/core/profiles/quickstart``, 4 steps of
``examples/quickstart.yaml`` on one CPU slot; ``tests/core/profiles/ppo``, 6 steps of it as PPO with ``PPO``'s
overrides; ``tests/core/profiles/reward_model``, 4 steps of it with ``RM``'s reward model) or written here with
known rates."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.placement.advice.advise import advise, plan_candidate
from hybridrl.placement.advice.profile import CostProfile, ProfileError, fit_line, fit_profile
from hybridrl.placement.plan import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).parent / "profiles" / "quickstart"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
QWEN7B = ROOT / "examples" / "qwen7b-colocated.yaml"
#: tests/core/profiles/ppo: 6 steps of the quick start as PPO (a critic colocated with the actor) on one CPU slot
RECORDED_PPO = Path(__file__).parent / "profiles" / "ppo"
PPO = ["algorithm.name=ppo", "algorithm.critic_warmup=0", "data.prompts_per_step=16", "algorithm.n_samples=8"]
#: tests/core/profiles/reward_model: 4 steps of the quick start with a tiny reward model beside its rule reward,
#: colocated with the actor on one CPU slot
RECORDED_RM = Path(__file__).parent / "profiles" / "reward_model"
RM = ["roles.reward.model.tiny.hidden_size=32"]


def _write_run(folder: Path, steps: list[tuple[float, float]], gen_a: float, gen_b: float, train_tps: float,
               ref_tps: float, devices: int = 2, skip: tuple[str, ...] = (),
               critic: tuple[float, float] | None = None, extra: dict | None = None) -> None:
    """A run folder whose phases took exactly what the given rates say: ``steps`` are (response length, prompt
    length); 4 prompts x 4 samples, one replica per device, ``devices`` devices in one colocated pool; ``critic``:
    the (values, update_critic) tokens/s per device of a critic on that pool too."""
    folder.mkdir(parents=True)
    sequences = 16
    spans, metrics = [], []
    t = 1000.0
    for step, (length, prompt) in enumerate(steps, 1):
        tokens = int(sequences * (length + prompt))
        phases = {"gen": gen_a + gen_b * length, "ref": tokens / (ref_tps * devices),
                  "update_actor": tokens / (train_tps * devices), "data": 0.1, "adv": 0.2, "reshard": 0.05}
        if critic is not None:
            phases |= {"values": tokens / (critic[0] * devices), "update_critic": tokens / (critic[1] * devices)}
        spans.append({"step": step, "phase": "step", "role": "driver", "pool": None, "ranks": [], "start": t,
                      "end": t + sum(phases.values()), "tokens": None})
        for phase, seconds in phases.items():
            if phase in skip:
                continue
            role = {"gen": "rollout", "ref": "ref", "update_actor": "actor", "reshard": "actor", "values": "critic",
                    "update_critic": "critic"}.get(phase, "driver")
            pooled = role != "driver"
            spans.append({"step": step, "phase": phase, "role": role, "pool": "main" if pooled else None,
                          "ranks": [[0, devices - 1]] if pooled else [], "start": t, "end": t + seconds,
                          "tokens": int(sequences * length) if phase == "gen" else tokens if pooled else None})
            t += seconds
        metrics.append({"step": step, "response_length/mean": length, "reshard/bytes": 0.0,
                        **{f"timing/{p}": s for p, s in phases.items()}})
    (folder / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    config = {"data": {"prompts_per_step": 4}, "algorithm": {"n_samples": 4, "kl": {"coef": 0.01}},
              "roles": {"actor": {"pool": "main"}, "ref": {"pool": "main"},
                        "rollout": {"pool": "main", "tensor_parallel": 1},
                        "critic": {"pool": "main"} if critic is not None else None}}
    (folder / "config.json").write_text(json.dumps(config | (extra or {})))


def test_the_fit_recovers_the_rates_a_run_was_made_with(tmp_path):
    steps = [(100.0, 20.0), (100.0, 20.0), (200.0, 20.0), (400.0, 30.0), (300.0, 10.0)]
    _write_run(tmp_path / "run", steps, gen_a=0.5, gen_b=0.02, train_tps=500.0, ref_tps=2000.0)
    profile = fit_profile(tmp_path / "run")
    assert profile.profiled
    assert profile.gen_fixed == pytest.approx(0.5, rel=1e-3)
    assert profile.gen_round == pytest.approx(0.02, rel=1e-3)
    assert profile.train_tps == pytest.approx(500.0, rel=1e-2)  # token counts are whole numbers
    assert profile.ref_tps == pytest.approx(2000.0, rel=1e-2)
    assert profile.fixed == pytest.approx(0.3)  # data + adv: the driver's work
    assert profile.response_length == pytest.approx(250.0)  # the first step (warm-up) left out


def test_one_response_length_fits_the_line_through_the_origin():
    assert fit_line([10.0, 10.0], [2.0, 2.0]) == (0.0, pytest.approx(0.2))
    assert fit_line([1.0, 2.0, 3.0], [1.5, 2.5, 3.5]) == (pytest.approx(0.5), pytest.approx(1.0))
    # a slope that falls with the length is noise (the first profile of the quick start fitted -0.09 s a round):
    # through the origin, so a longer response never predicts a shorter generation
    a, b = fit_line([2.90, 2.95, 3.00], [0.030, 0.020, 0.021])
    assert a == 0.0 and b == pytest.approx(sum(x * y for x, y in zip([2.90, 2.95, 3.00], [0.030, 0.020, 0.021])) /
                                           sum(x * x for x in [2.90, 2.95, 3.00])) and b > 0


def test_the_recorded_quickstart_profile_fits():
    profile = fit_profile(RECORDED)
    assert profile.profiled and "3 step(s)" in profile.source
    assert 0 < profile.train_tps < float("inf") and 0 < profile.ref_tps < float("inf")
    assert profile.response_length == pytest.approx(2.96, abs=0.05)  # quickstart answers 2 digits + EOS
    assert profile.gen_round > 0


def test_the_fit_recovers_a_critics_rates(tmp_path):
    steps = [(100.0, 20.0), (200.0, 20.0), (300.0, 10.0)]
    _write_run(tmp_path / "run", steps, 0.5, 0.02, 500.0, 2000.0, critic=(1500.0, 400.0))
    profile = fit_profile(tmp_path / "run")
    assert profile.values_tps == pytest.approx(1500.0, rel=1e-2)
    assert profile.critic_train_tps == pytest.approx(400.0, rel=1e-2)
    assert profile.fixed == pytest.approx(0.3)  # the critic's phases are modelled, not the driver's work


def test_a_critic_profile_without_update_critic_names_it(tmp_path):
    _write_run(tmp_path / "run", [(10.0, 5.0), (20.0, 5.0)], 0.1, 0.01, 100.0, 100.0, critic=(100.0, 100.0),
               skip=("update_critic",))
    with pytest.raises(ProfileError, match="no spans of update_critic"):
        fit_profile(tmp_path / "run")


def test_a_critic_warm_up_without_actor_updates_is_explained(tmp_path):
    _write_run(tmp_path / "run", [(10.0, 5.0), (20.0, 5.0)], 0.1, 0.01, 100.0, 100.0, critic=(100.0, 100.0),
               skip=("update_actor",), extra={"algorithm": {"n_samples": 4, "critic_warmup": 5}})
    with pytest.raises(ProfileError, match=r"critic trains alone for algorithm.critic_warmup=5 steps"):
        fit_profile(tmp_path / "run")


def free_collectives(profile: CostProfile) -> CostProfile:
    """``profile`` with collectives that cost nothing (no latency, endless bandwidth): linear data parallelism."""
    return replace(profile, latency={k: 0.0 for k in profile.latency},
                   bandwidth={k: float("inf") for k in profile.bandwidth})


def _ppo_ranked(profile: CostProfile, nodes: int, devices: int) -> list:
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(nodes, devices, "cpu", declared=True)
    registry = get_registry(())
    planner = plan_candidate(cluster, registry, None, model_shape(load_config(QUICKSTART, PPO))[0])
    return advise(QUICKSTART, PPO, cluster, profile, planner, registry=registry)


def test_the_recorded_ppo_profile_predicts_its_own_step():
    """The profiled map (colocated on one CPU slot) is predicted within 20% of the steps it was fitted from,
    with the critic's phases in the prediction."""
    profile = fit_profile(RECORDED_PPO)
    assert 0 < profile.values_tps < float("inf") and 0 < profile.critic_train_tps < float("inf")
    rows = [json.loads(line) for line in (RECORDED_PPO / "metrics.jsonl").read_text().splitlines()][1:]
    measured = sum(r["timing/step"] for r in rows) / len(rows)
    kept = {r.candidate.name: r for r in _ppo_ranked(profile, 1, 1) if r.prediction is not None}
    # in flight: the colocated step with its generation IN_FLIGHT_GEN times as long (the transformers rollout
    # declares no log-prob cost), within that model's error
    from hybridrl.placement.advice.predict import IN_FLIGHT_GEN

    assert set(kept) == {"colocated 1x1", "in-flight 1x1", "fractional 1x1"}
    colocated, in_flight = kept["colocated 1x1"].prediction, kept["in-flight 1x1"].prediction
    assert kept["in-flight 1x1"].planned.cfg.roles.rollout.log_probs is True  # importance sampling reads them
    assert in_flight.phases["gen"] == pytest.approx(colocated.phases["gen"] * IN_FLIGHT_GEN)
    assert in_flight.step == pytest.approx(colocated.step + in_flight.phases["gen"] - colocated.phases["gen"])
    slower = "colocated 1x1" if in_flight.step < colocated.step else "in-flight 1x1"
    assert "measure both" in kept[slower].why
    ranked = kept["colocated 1x1"]
    p = ranked.prediction
    assert p.step == pytest.approx(measured, rel=0.2)
    for phase in ("values", "update_critic"):
        seen = sum(r[f"timing/{phase}"] for r in rows) / len(rows)
        assert p.phases[phase] == pytest.approx(seen, rel=0.2)
    assert p.critic == pytest.approx(p.phases["values"] + p.phases["update_critic"])


def test_a_critic_gets_a_pool_of_its_own_and_is_time_shared_when_colocated(capsys):
    profile = free_collectives(fit_profile(RECORDED_PPO))
    ranked = {r.candidate.name: r for r in _ppo_ranked(profile, 1, 4)}
    colocated, own = ranked["colocated 1x4"].prediction, ranked["split train 1x2:critic 1x1:gen 1x1"].prediction
    assert colocated and own
    one = next(r.prediction for r in _ppo_ranked(profile, 1, 1) if r.prediction)
    assert colocated.critic == pytest.approx(one.critic / 4)  # on all 4 devices, in turn with the other phases
    paid = next(r.prediction for r in _ppo_ranked(fit_profile(RECORDED_PPO), 1, 4)
                if r.candidate.name == "colocated 1x4")
    assert paid is not None and paid.critic > colocated.critic  # 4 ranks' gloo collectives cost time
    assert own.critic == pytest.approx(one.critic)  # on its 1 device; the trainer still waits for it
    assert set(own.busy) == {"train", "critic", "gen"}
    assert own.busy["critic"] == pytest.approx(own.critic / own.step)
    assert "critic on fewer devices" in ranked["split train 1x2:critic 1x1:gen 1x1"].why
    assert main(["plan", str(QUICKSTART), *PPO, "--advise", "--device", "cpu", "--cluster", "1x4",
                 "--profile", str(RECORDED_PPO)]) == 0
    out = capsys.readouterr().out
    assert "critic s" in out.splitlines()[1] and "split train 1x2:critic 1x1:gen 1x1" in out


def _rm_ranked(profile: CostProfile, devices: int, overrides: list[str] = RM) -> dict:
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(1, devices, "cpu", declared=True)
    registry = get_registry(())
    planner = plan_candidate(cluster, registry, None, model_shape(load_config(QUICKSTART, overrides))[0])
    return {r.candidate.name: r for r in advise(QUICKSTART, overrides, cluster, profile, planner, registry=registry)}


def test_the_recorded_reward_model_profile_predicts_its_own_step():
    """A reward model's phase is fitted as a rate of its pool (not driver work), and the profiled map is predicted
    within 20% of the steps it was fitted from; without a reward model the rule rewards stay fixed work."""
    profile = fit_profile(RECORDED_RM)
    assert 0 < profile.reward_tps < float("inf")
    rows = [json.loads(line) for line in (RECORDED_RM / "metrics.jsonl").read_text().splitlines()][1:]
    reward = sum(r["timing/reward"] for r in rows) / len(rows)
    assert profile.fixed < reward  # the scoring is the model's phase, not the driver's
    p = _rm_ranked(profile, 1)["colocated 1x1"].prediction
    assert p is not None and p.phases["reward"] == pytest.approx(reward, rel=0.2)
    assert p.step == pytest.approx(sum(r["timing/step"] for r in rows) / len(rows), rel=0.2)
    rule_only = fit_profile(RECORDED)
    assert rule_only.reward_tps == float("inf")
    assert "reward" not in _rm_ranked(rule_only, 1, [])["colocated 1x1"].prediction.phases


def test_a_reward_model_gets_a_pool_of_its_own_and_is_time_shared_when_colocated(capsys):
    profile = free_collectives(fit_profile(RECORDED_RM))
    ranked = _rm_ranked(profile, 4)
    one = _rm_ranked(profile, 1)["colocated 1x1"].prediction
    colocated, own = ranked["colocated 1x4"].prediction, ranked["split train 1x2:reward 1x1:gen 1x1"].prediction
    assert one and colocated and own
    speedup = profile.data_parallel_speedup([4], "cpu")  # CPU slots of one node share its cores
    assert colocated.phases["reward"] == pytest.approx(one.phases["reward"] / speedup)
    assert own.phases["reward"] == pytest.approx(one.phases["reward"])  # its 1 device; the trainer waits for it
    assert set(own.busy) == {"train", "reward", "gen"}
    assert own.busy["reward"] == pytest.approx(own.phases["reward"] / own.step)
    assert own.step == pytest.approx(sum(own.phases.values()))  # sync split: every phase in turn
    assert main(["plan", str(QUICKSTART), *RM, "--advise", "--device", "cpu", "--cluster", "1x4",
                 "--profile", str(RECORDED_RM)]) == 0
    out = capsys.readouterr().out
    assert "split train 1x2:reward 1x1:gen 1x1" in out


@pytest.mark.parametrize(("overrides", "missing"), [
    (PPO, "has no rates for a critic (values, update_critic), which this config runs"),
    (RM, "has no rates for a reward model (reward), which this config runs"),
    (["algorithm.kl.coef=0"], None),  # a phase the profile ran and the config does not: nothing to price
])
def test_a_profile_without_a_phase_the_config_runs_is_refused(overrides, missing, capsys):
    """The quick start's profile has no critic and no reward model: planning a config that runs one from it
    would predict that phase free, so the command says what the profile lacks and how to get one."""
    status = main(["plan", str(QUICKSTART), *overrides, "--advise", "--device", "cpu", "--cluster", "1x2",
                   "--profile", str(RECORDED)])
    err = capsys.readouterr().err
    if missing is None:
        assert status == 0, err
        return
    assert status == 2 and missing in err and "--profile-steps 3" in err and "Traceback" not in err


def test_old_log_probs_a_profile_skipped_cost_the_references_forward():
    """The quick start's profile skipped the old log-probs (one optimizer step); two epochs run the pass, priced
    at the reference's rate (the same model's forward), not free."""
    profile = fit_profile(RECORDED)
    assert profile.old_log_prob_tps == float("inf") and profile.ref_tps < float("inf")
    p = _rm_ranked(profile, 1, ["algorithm.epochs=2"])["colocated 1x1"].prediction
    assert p is not None and p.phases["old_log_prob"] == pytest.approx(p.phases["ref"])


def test_a_profile_of_another_device_or_model_size_is_named(tmp_path, capsys):
    """The tiny quick start profiled on a CPU slot, used to plan a 7B model on GPUs: its rates are used as they
    are, and the table says whose they are; the JSON carries the same notes."""
    profile = fit_profile(RECORDED_RM)
    assert profile.device == "cpu" and profile.active_params is not None and profile.active_params < 10**6
    out = tmp_path / "advice.json"
    assert main(["plan", str(QWEN7B), "--advise", "--cluster", "1x8", "--profile", str(RECORDED_RM),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    notes = json.loads(out.read_text())["notes"]
    assert any(n.startswith("the profile ran on cpu, these maps are for cuda") for n in notes)
    assert any("this config's 7.6" in n and "profile the model you plan for" in n for n in notes)
    assert all(f"note: {n}" in printed for n in notes)
    assert main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", "--cluster", "1x2", "--profile",
                 str(RECORDED_RM), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == []
    assert main(["plan", str(QUICKSTART), "roles.rollout.backend=vllm", "--advise", "--device", "cpu", "--cluster",
                 "1x2", "--profile", str(RECORDED_RM), "--skip-engine-check", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == [
        "the profile's rollout ran on 'hf', this config's on 'vllm': its rates are another backend's"]


def test_the_default_gpu_costs_name_the_backends_they_were_measured_with(tmp_path):
    """Unprofiled GPU costs are fitted from FSDP and vLLM steps: a config whose rollout is another backend's (the
    7B example's transformers rollout) gets a note, one of FSDP and vLLM none."""
    out = tmp_path / "advice.json"
    assert main(["plan", str(QWEN7B), "--advise", "--cluster", "1x8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == [
        "the profile's rollout ran on 'vllm', this config's on 'hf': its rates are another backend's"]
    assert main(["plan", str(QWEN7B), "roles.rollout.backend=vllm", "--advise", "--cluster", "1x8",
                 "--skip-engine-check", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["notes"] == []


def test_more_cpu_slots_than_the_profiles_cores_are_named(capsys):
    """Ranks beyond a node's cores take turns on them, which the model does not count: the table says so."""
    cores = fit_profile(RECORDED_RM).node_cores
    assert cores is not None
    for slots, warned in ((cores, False), (cores + 1, True)):
        assert main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", "--cluster", f"1x{slots}",
                     "--profile", str(RECORDED_RM)]) == 0
        note = f"note: {slots} CPU slots a node, and the profile's node has {cores} cores"
        assert (note in capsys.readouterr().out) == warned


def _best_split_gen_devices(profile: CostProfile) -> int:
    cluster = ClusterSpec(1, 8, "cpu", declared=True)
    registry = __import__("hybridrl.plugins.discovery", fromlist=["get_registry"]).get_registry(())
    vllm = ["roles.rollout.backend=vllm"]  # an engine that shards: generation gains from more devices per engine
    cfg = load_config(QUICKSTART, vllm)
    from hybridrl.placement.memory import model_shape

    planner = plan_candidate(cluster, registry, None, model_shape(cfg)[0])
    ranked = advise(QUICKSTART, vllm, cluster, profile, planner)
    best = next(r for r in ranked if r.prediction is not None and r.candidate.kind in ("split", "pipelined"))
    return best.candidate.devices("gen")


def test_a_gen_heavy_profile_gives_generation_more_devices():
    base = fit_profile(RECORDED)
    gen_heavy = replace(base, gen_round=base.gen_round * 1000, gen_fixed=0.0)
    train_heavy = replace(base, gen_round=base.gen_round / 1000, train_tps=base.train_tps / 10)
    assert _best_split_gen_devices(gen_heavy) > _best_split_gen_devices(train_heavy)


def test_maps_the_memory_models_refuse_are_dropped_with_the_reason(capsys):
    status = main(["plan", str(QWEN7B), "--advise", "--cluster", "1x2", "--device-memory", "40",
                   "--skip-engine-check"])
    out = capsys.readouterr().out
    assert status == 0
    dropped = [line for line in out.splitlines() if line.startswith("-  ") and not set(line) <= {"-", " "}]
    assert dropped and all("memory: pool" in line and "GiB" in line for line in dropped)
    assert "unprofiled" in out


def test_a_backend_without_a_memory_model_is_named(monkeypatch):
    import hybridrl.placement.auto as auto

    real = auto.memory_models
    monkeypatch.setattr(auto, "memory_models", lambda *a, **k: {**real(*a, **k), "rollout": None})
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(1, 2, "cuda", declared=True)
    cfg = load_config(QWEN7B)
    ranked = advise(QWEN7B, [], cluster, fit_profile(RECORDED),
                    plan_candidate(cluster, get_registry(()), 80 * 2**30, model_shape(cfg, None, [ROOT])[0]),
                    rollout_tp=False)
    assert ranked and all(r.prediction is None for r in ranked)
    assert all("backend 'hf' of role rollout registers no memory model" in r.why for r in ranked)


def test_write_keeps_the_users_keys_and_adds_the_winners_overrides(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    status = main(["plan", str(QUICKSTART), "--advise", "--cluster", "1x2", "--device", "cpu",
                   "--profile", str(RECORDED), "--write", str(out), "trainer.steps=7"])
    text = capsys.readouterr().out
    assert status == 0 and "profile" in text and "unprofiled" not in text
    best = next(line for line in text.splitlines() if line.startswith("best: "))
    written = load_config(out)
    assert written.trainer.steps == 7 and written.trainer.trackers == ["console", "jsonl"]  # the user's keys
    for override in best.split(": ", 2)[2].split():
        key, _, value = override.partition("=")
        if value == "null":
            assert key.split(".")[1] not in written.pools
        elif key == "roles.rollout.pool":
            assert written.roles.rollout.pool == value


@pytest.mark.parametrize(("args", "words"), [
    (["--cluster", "2by8"], "expected NODESxDEVICES like 2x8, each at least 1, got '2by8'"),
    (["--cluster", "1x2", "--profile", "no/such/run"], "no such run folder"),
    (["--cluster", "1x2", "--bandwidth", "warp=9"], "expected KIND=GB/s"),
    (["--cluster", "1x2", "--latency", "tcp=-1"], "expected KIND=ms"),
    (["--cluster", "1x2", "--profile-steps", "1"], "--profile-steps: needs at least 2 steps"),
    (["--cluster", "1x2", "--profile-steps", "3", "--profile", "x"], "either --profile RUN or --profile-steps N"),
    (["--cluster", "0x8"], "--cluster: expected NODESxDEVICES like 2x8, each at least 1, got '0x8'"),
    (["--cluster", "1x0"], "each at least 1, got '1x0'"),
    (["--cluster", "1x2", "--device-memory", "-5"], "--device-memory: expected a positive number of GiB, got -5"),
    (["--cluster", "1x2", "--host-memory", "0"], "--host-memory: expected a positive number of GiB, got 0"),
    (["--cluster", "1x2", "--model-config", "no/such/config.json"], "--model-config: no model config at"),
    (["--cluster", "1x2", "--json", "no/such/folder/advice.json"], "--json: the folder of"),
    (["--cluster", "1x2", "--write", str(QUICKSTART)], "--write: '" + str(QUICKSTART) + "' is the config being"),
    (["--cluster", "1x2", "--write", str(QUICKSTART.parent)], "is a folder; give a file path"),
    (["--cluster", "1x2", "--write", "a.yaml", "--json", "a.yaml"], "--json: 'a.yaml' is also --write's file"),
])
def test_bad_input_is_one_sentence_and_exit_status_2(args, words, capsys):
    assert main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_bad_output_path_is_refused_before_the_profiling_run(tmp_path, capsys):
    """The flags are checked first: a run to profile is not trained only for its advice to fail at the end."""
    status = main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", "--cluster", "1x2", "--profile-steps", "3",
                   "--write", str(tmp_path / "missing" / "best.yaml"), "--device-memory", "0"])
    captured = capsys.readouterr()
    assert status == 2 and "profiling:" not in captured.out
    assert "(2 problems)" in captured.err and "--write: the folder of" in captured.err
    assert "--device-memory: expected a positive number" in captured.err


def test_plan_without_advise_refuses_a_missing_model_config(capsys):
    """An explicit --model-config that cannot be read is an error, not a plan whose memory table is skipped."""
    assert main(["plan", str(QUICKSTART), "--device", "cpu", "--cluster", "1x1", "--model-config", "nope"]) == 2
    assert "--model-config: no model config at 'nope" in capsys.readouterr().err


def test_a_profile_without_spans_says_how_to_record_one(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("metrics.jsonl", "config.json"):
        (RECORDED / name).read_text()
        (tmp_path / "run" / name).write_text((RECORDED / name).read_text())
    with pytest.raises(ProfileError, match=r"no spans.jsonl; record one with `hybridrl train CONFIG"):
        fit_profile(tmp_path / "run")


def test_a_profile_missing_a_phase_names_it(tmp_path):
    _write_run(tmp_path / "run", [(10.0, 5.0), (20.0, 5.0)], 0.1, 0.01, 100.0, 100.0, skip=("update_actor",))
    with pytest.raises(ProfileError, match="no spans of update_actor") as exc:
        fit_profile(tmp_path / "run")
    assert exc.value.exit_status == 2


def test_profile_and_write_need_advise(capsys):
    assert main(["plan", str(QUICKSTART), "--device", "cpu", "--cluster", "1x1", "--write", "x.yaml"]) == 2
    assert "--write: only with --advise" in capsys.readouterr().err
    assert main(["plan", str(QUICKSTART), "--device", "cpu", "--cluster", "1x1", "--profile-steps", "3"]) == 2
    assert "--profile-steps: only with --advise" in capsys.readouterr().err


def test_the_ranked_table_is_written_as_json(tmp_path, capsys):
    out = tmp_path / "advice.json"
    assert main(["plan", str(QUICKSTART), "--device", "cpu", "--cluster", "1x1", "--json", str(out)]) == 2
    assert "--json: only with --advise" in capsys.readouterr().err
    assert main(["plan", str(QUICKSTART), "--advise", "--cluster", "1x2", "--skip-engine-check",
                 "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    printed = capsys.readouterr().out
    kept = [r for r in table["rows"] if r["rank"] is not None]
    assert table["cluster"].startswith("1 node(s) x 2") and table["device_memory_gib"] == 80.0
    assert [r["rank"] for r in kept] == list(range(1, len(kept) + 1)) and kept[0]["why_it_loses"] == "best"
    assert f"best: {kept[0]['map']}: " in printed
    steps = [r["predicted_step_s"] for r in kept]
    assert steps == sorted(steps) or kept[0]["samples_per_s"] >= max(r["samples_per_s"] for r in kept)
    assert {"colocated", "fractional", "split", "pipelined"} <= {r["kind"] for r in table["rows"]}


def test_profile_steps_trains_the_config_first_and_fits_that_run(capsys):
    assert main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", "--cluster", "1x2",
                 "--profile-steps", "3"]) == 0
    out = capsys.readouterr().out
    folder = Path(out.split("reuse it with --profile ", 1)[1].split()[0])
    try:
        assert (folder / "spans.jsonl").is_file() and len((folder / "metrics.jsonl").read_text().splitlines()) == 3
        assert f"costs: profile {folder} (2 step(s))" in out  # the first step left out as warm-up
        assert "best: " in out
        profile = fit_profile(folder)  # the run's device map says what its CPU slot computed with
        assert profile.slot_threads is not None and profile.node_cores is not None
        assert 1 <= profile.slot_threads <= profile.node_cores
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_the_step_adds_serial_phases_and_overlaps_pipelined_ones():
    """Colocated and sync split: the phases one after the other; pipelined: the longer of gen and train."""
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(1, 2, "cpu", declared=True)
    profile = fit_profile(RECORDED)
    planner = plan_candidate(cluster, get_registry(()), None, model_shape(load_config(QUICKSTART))[0])
    ranked = {r.candidate.name: r.prediction for r in advise(QUICKSTART, [], cluster, profile, planner)}
    colocated, split, pipelined = (ranked["colocated 1x2"], ranked["split train 1x1:gen 1x1"],
                                   ranked["pipelined train 1x1:gen 1x1"])
    assert colocated and split and pipelined
    assert colocated.step == pytest.approx(sum(colocated.phases.values()))
    assert "wake" not in split.phases and split.step == pytest.approx(sum(split.phases.values()))
    p = pipelined.phases
    assert "old_log_prob" not in p  # one optimizer step a batch: the trainer skips the pass
    train = p.get("ref", 0.0) + p["update_actor"]
    assert pipelined.step == pytest.approx(max(p["gen"], train) + p["reshard"] + p["fixed"])
    assert pipelined.step < split.step
    assert split.samples_per_s == pytest.approx(16 * 16 / split.step)  # quickstart: 16 prompts x 16 samples
    # fractional on CPU slots: the node's cores do both pools' work, nothing overlaps (no wake and sleep)
    fractional = ranked["fractional 1x2"]
    f = fractional.phases
    assert "wake" not in f and fractional.bound == "shared cores" and fractional.error_band is None
    assert fractional.step == pytest.approx(sum(f.values()))
    assert fractional.step < colocated.step


def test_a_fractional_map_on_gpus_time_slices_them():
    """On GPUs the rollout's and the trainers' processes time-slice the devices (the fitted one-GPU model), and
    the model's measured error goes with the prediction."""
    from hybridrl.placement.advice.predict import TIME_SLICED_ERROR, TIME_SLICED_GEN, TIME_SLICED_TRAIN
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(1, 1, "cuda", declared=True)
    planner = plan_candidate(cluster, get_registry(()), 80 * 2**30, model_shape(load_config(QUICKSTART))[0])
    ranked = {r.candidate.name: r.prediction for r in advise(QUICKSTART, [], cluster, fit_profile(RECORDED), planner)}
    fractional = ranked["fractional 1x1"]
    assert fractional is not None and fractional.bound == "time-sliced"
    assert fractional.error_band == TIME_SLICED_ERROR and ranked["colocated 1x1"].error_band is None
    f = fractional.phases
    gen, train = f["gen"], f.get("ref", 0.0) + f["update_actor"]
    sliced = max(gen, train, TIME_SLICED_GEN * gen + TIME_SLICED_TRAIN * train)
    assert fractional.step == pytest.approx(sliced + f["reshard"] + f["fixed"])


def test_a_fractional_map_on_gpus_is_not_charged_the_log_probs_an_in_flight_one_is():
    """Both asynchronous maps ask the rollout for log-probs; measured on GPUs, the fractional generation hid that
    cost beside the trainer (the fit reads it uncharged), while the in-flight one pays it in the step."""
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    registry = get_registry(())
    cost = registry.backend("rollout", "vllm").log_prob_cost
    cluster = ClusterSpec(1, 1, "cuda", declared=True)
    planner = plan_candidate(cluster, registry, 80 * 2**30, model_shape(load_config(QUICKSTART))[0])
    ranked = {r.candidate.name: r for r in advise(QUICKSTART, ["roles.rollout.backend=vllm"], cluster,
                                                  fit_profile(RECORDED), planner, registry=registry)}
    colocated, flight, fractional = (ranked[m].prediction for m in ("colocated 1x1", "in-flight 1x1",
                                                                      "fractional 1x1"))
    assert ranked["fractional 1x1"].planned.cfg.roles.rollout.log_probs is True
    assert fractional.log_prob_factor == 1.0 and fractional.phases["gen"] == pytest.approx(colocated.phases["gen"])
    assert flight.log_prob_factor == pytest.approx(cost) and flight.phases["gen"] > colocated.phases["gen"]


def test_groups_in_flight_are_a_colocated_candidate_for_a_rollout_that_resumes(capsys):
    """Each colocated map also with ``trainer.mode=async`` (partial rollouts), predicted as the synchronous step
    with its generation as long as measured in flight (the cost model counts a step's mean response length: no
    tail to cut); a rollout backend without ``partial`` has it dropped by the pre-flight, with the key."""
    from hybridrl.placement.advice.predict import IN_FLIGHT_GEN
    from hybridrl.plugins.discovery import get_registry

    # the vLLM rollout declares what its log-probs cost; the run in flight asks for them (importance sampling)
    cost = get_registry(()).backend("rollout", "vllm").log_prob_cost
    assert cost is not None and cost > 1
    ranked = _quickstart_maps(fit_profile(RECORDED), overrides=("roles.rollout.backend=vllm",))
    colocated, in_flight = ranked["colocated 1x2 tp2"], ranked["in-flight 1x2 tp2"]
    assert in_flight.candidate.kind == "in_flight" and "trainer.mode=async" in in_flight.candidate.overrides
    assert in_flight.prediction is not None and colocated.prediction is not None
    assert in_flight.prediction.phases["gen"] == pytest.approx(colocated.prediction.phases["gen"] * cost *
                                                                IN_FLIGHT_GEN)
    assert in_flight.prediction.step > colocated.prediction.step
    assert f"gen x{cost:.2f}" in in_flight.why and "no tail" in in_flight.why and "measure both" in in_flight.why
    status = main(["plan", str(QWEN7B), "roles.rollout.backend=sglang", "--advise", "--cluster", "1x2",
                   "--skip-engine-check"])
    out = capsys.readouterr().out
    assert status == 0
    dropped = [line for line in out.splitlines() if line.startswith("-  in-flight 1x2")]
    assert dropped and "partial" in dropped[0], out


@pytest.mark.parametrize("backend, offers_tp", [("hf", False), ("vllm", True)])
def test_rollout_tensor_parallelism_is_offered_only_to_a_backend_that_shards(backend, offers_tp, capsys):
    status = main(["plan", str(QWEN7B), f"roles.rollout.backend={backend}", "--advise", "--cluster", "1x4",
                   "--skip-engine-check"])
    out = capsys.readouterr().out
    assert status == 0
    assert (" tp2" in out) is offers_tp, out
    assert "tensor_parallel" not in "\n".join(line for line in out.splitlines() if line.startswith("-  "))


# --- collectives and shared cores: pools of several ranks -------------------------------------------------------
def test_each_map_is_planned_as_its_run_resolves_it():
    """The advisor plans a map in flight with the oversampling its run adds (more sequences in the KV cache) and
    every asynchronous map with the log-probs importance sampling reads; a profile whose own rollout returned
    log-probs has them taken off the generation of a map that asks for none."""
    from hybridrl.placement.advice.predict import log_prob_factor

    profile = fit_profile(RECORDED)
    assert profile.log_probs is False  # the recorded quick start is synchronous
    ranked = _quickstart_maps(profile, overrides=("roles.rollout.backend=vllm",))
    flight, colocated = ranked["in-flight 1x2 tp2"].planned.cfg, ranked["colocated 1x2 tp2"].planned.cfg
    pipelined = ranked["pipelined train 1x1:gen 1x1"].planned.cfg
    assert flight.roles.rollout.oversample == 1.25 and colocated.roles.rollout.oversample == 1.0
    assert flight.roles.rollout.log_probs is True and pipelined.roles.rollout.log_probs is True
    assert flight.roles.rollout.options["workload"]["sequences"] > colocated.roles.rollout.options["workload"][
        "sequences"]
    assert colocated.roles.rollout.log_probs is False
    assert log_prob_factor(colocated, replace(profile, log_probs=True), 1.32) == pytest.approx(1 / 1.32)
    assert log_prob_factor(flight, replace(profile, log_probs=True), 1.32) == 1.0


def test_a_config_that_spells_the_trainer_mode_keeps_every_map_kind():
    """A run's resolved ``config.json`` spells ``trainer.mode: sync``; the pipelined and fractional maps still
    plan (their keys set the mode), and a config in ``mode: async`` still gets a synchronous colocated map."""
    for mode in ("sync", "async"):
        ranked = _quickstart_maps(fit_profile(RECORDED), overrides=(f"trainer.mode={mode}",))
        for name in ("colocated 1x2", "in-flight 1x2", "fractional 1x2", "pipelined train 1x1:gen 1x1"):
            assert ranked[name].prediction is not None, (mode, name, ranked[name].why)
        assert "trainer.mode=sync" in ranked["colocated 1x2"].candidate.overrides
        assert "trainer.mode=async" in ranked["fractional 1x2"].candidate.overrides


def _quickstart_maps(profile: CostProfile, nodes: int = 1, devices: int = 2, overrides: tuple[str, ...] = ()
                     ) -> dict:
    """The quick start's ranked maps on ``nodes x devices`` CPU slots, by name (``Ranked``)."""
    from hybridrl.placement.memory import model_shape
    from hybridrl.plugins.discovery import get_registry

    cluster = ClusterSpec(nodes, devices, "cpu", declared=True)
    shape = model_shape(load_config(QUICKSTART, list(overrides)))[0]
    registry = get_registry(())
    planner = plan_candidate(cluster, registry, None, shape)
    return {r.candidate.name: r for r in advise(QUICKSTART, list(overrides), cluster, profile, planner,
                                                registry=registry)}


def test_two_cpu_slots_sharing_the_profiles_cores_predict_slower_than_linear_scaling():
    base = fit_profile(RECORDED)
    shared = replace(base, slot_threads=2, node_cores=2)  # the profiled slot already had both of the node's cores
    linear = _quickstart_maps(free_collectives(base))["colocated 1x2"].prediction
    capped = _quickstart_maps(free_collectives(shared))["colocated 1x2"].prediction
    paid = _quickstart_maps(shared)["colocated 1x2"].prediction
    one = _quickstart_maps(shared)["split train 1x1:gen 1x1"].prediction  # one rank per pool: the profile's rates
    assert linear and capped and paid and one
    assert linear.phases["ref"] == pytest.approx(one.phases["ref"] / 2)  # the old model: half on two ranks
    assert capped.phases["ref"] == pytest.approx(one.phases["ref"])  # two slots share the cores: no gain
    for phase in ("ref", "update_actor", "reshard"):  # and the gloo collectives come on top
        assert paid.phases[phase] > capped.phases[phase]
    assert paid.step > capped.step > linear.step


def test_cpu_slots_scale_up_to_the_cores_the_profiles_slot_left_free():
    one_thread = replace(fit_profile(RECORDED), slot_threads=1, node_cores=16)
    assert one_thread.data_parallel_speedup([4], "cpu") == 4  # 4 slots, 16 cores, the profile used 1
    assert one_thread.data_parallel_speedup([32], "cpu") == 16  # at most the node's cores
    assert one_thread.data_parallel_speedup([32, 32], "cpu") == 32  # per node
    whole = replace(one_thread, slot_threads=16)
    assert whole.data_parallel_speedup([4], "cpu") == 1 and whole.data_parallel_speedup([4], "cuda") == 4
    assert replace(whole, slot_threads=None).data_parallel_speedup([4], "cpu") == 4  # not recorded: linear


def test_one_rank_pools_pay_no_collectives():
    base = fit_profile(RECORDED)
    slow = replace(base, latency={k: 1.0 for k in base.latency}, slot_threads=2, node_cores=2)
    for nodes, devices, name in ((1, 2, "split train 1x1:gen 1x1"), (1, 2, "pipelined train 1x1:gen 1x1"),
                                 (1, 1, "colocated 1x1")):
        before = _quickstart_maps(base, nodes, devices)[name].prediction
        after = _quickstart_maps(slow, nodes, devices)[name].prediction
        assert before and after and after.phases == before.phases and after.step == before.step


def test_more_layers_pay_more_collective_latency():
    from hybridrl.placement.advice.predict import fsdp_collectives

    assert fsdp_collectives(4, 1, backward=False) == 4 + 1 + 1  # a gather per layer and the root, a count check
    assert fsdp_collectives(4, 1, backward=True) == 3 * 5 + 3  # gather, re-gather, reduce-scatter; 3 all-reduces
    assert fsdp_collectives(4, 2, backward=True, optimizer_steps=2) == 2 * 3 * 5 + 2 * 3
    assert fsdp_collectives(8, 1, backward=True) > fsdp_collectives(4, 1, backward=True)
    latency = 1.0  # a second a collective, the bytes free: the phases' difference is the count's
    profile = replace(free_collectives(fit_profile(RECORDED)), latency={"tcp": latency, "self": 0.0})
    four = _quickstart_maps(profile)["colocated 1x2"].prediction
    eight = _quickstart_maps(profile, overrides=("model.tiny.num_layers=8",))["colocated 1x2"].prediction
    assert four and eight
    assert eight.phases["ref"] - four.phases["ref"] == pytest.approx(4 * latency)
    assert eight.phases["update_actor"] - four.phases["update_actor"] == pytest.approx(3 * 4 * latency)
    assert eight.phases["reshard"] - four.phases["reshard"] == pytest.approx(4 * 12 * latency)  # 12 tensors a layer


def test_the_reshard_gathers_each_parameter_tensor_of_a_sharded_trainer():
    from hybridrl.model.tiny import tiny_hf_config
    from hybridrl.placement.memory import model_shape

    cfg = load_config(QUICKSTART)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(cfg.model.tiny))
    assert model_shape(cfg)[0].tensor_count() == len(list(model.named_parameters())) == 50
    maps = _quickstart_maps(fit_profile(RECORDED))
    assert maps["colocated 1x2"].planned.reshard.gather_collectives == 50
    assert maps["split train 1x1:gen 1x1"].planned.reshard.gather_collectives == 0  # one rank exports its own


def test_the_latency_table_is_used_by_link_kind(tmp_path, capsys):
    from types import SimpleNamespace

    from hybridrl.placement.advice.predict import pool_link
    from hybridrl.placement.advice.profile import LINK_BANDWIDTH, LINK_LATENCY
    from hybridrl.placement.plan import Device

    assert set(LINK_LATENCY) == set(LINK_BANDWIDTH) and LINK_LATENCY["tcp"] > LINK_LATENCY["nvlink"] > 0

    def plan(device: str, nodes: int) -> SimpleNamespace:
        return SimpleNamespace(cluster=SimpleNamespace(device=device),
                               pools={"main": [Device(n, i) for n in range(nodes) for i in range(2)]})

    assert [pool_link(plan(d, n), "main") for d, n in (("cpu", 1), ("cuda", 1), ("cuda", 2))] == \
        ["tcp", "nvlink", "net"]
    base = fit_profile(RECORDED)
    gpu_links = replace(base, latency={**base.latency, "nvlink": 9.0, "net": 9.0, "pcie": 9.0})
    tcp_slower = replace(base, latency={**base.latency, "tcp": base.latency["tcp"] + 0.01})
    step = {name: _quickstart_maps(p)["colocated 1x2"].prediction.step
            for name, p in (("base", base), ("gpu", gpu_links), ("tcp", tcp_slower))}
    assert step["gpu"] == step["base"]  # CPU slots talk over tcp only
    collectives = 6 + 18 + 50  # ref, update, the reshard's gathers
    assert step["tcp"] - step["base"] == pytest.approx(collectives * 0.01)
    steps = {}
    for ms in ("0", "20"):
        out = tmp_path / f"latency{ms}.json"
        assert main(["plan", str(QUICKSTART), "--advise", "--device", "cpu", "--cluster", "1x2", "--profile",
                     str(RECORDED), "--latency", f"tcp={ms}", "--json", str(out)]) == 0
        steps[ms] = next(r["predicted_step_s"] for r in json.loads(out.read_text())["rows"]
                         if r["map"] == "colocated 1x2")
    capsys.readouterr()
    assert steps["20"] - steps["0"] == pytest.approx(collectives * 0.020, abs=2e-3)


def test_the_fit_reads_the_slots_threads_and_cores_from_the_device_map(tmp_path):
    steps = [(10.0, 5.0), (20.0, 5.0)]
    _write_run(tmp_path / "old", steps, 0.1, 0.01, 100.0, 100.0)
    assert (fit_profile(tmp_path / "old").slot_threads, fit_profile(tmp_path / "old").node_cores) == (None, None)
    _write_run(tmp_path / "run", steps, 0.1, 0.01, 100.0, 100.0)
    rows = [{"pool": "main", "rank": r, "threads": 4, "cores": 8} for r in range(2)]
    (tmp_path / "run" / "device_map.json").write_text(json.dumps(rows))
    profile = fit_profile(tmp_path / "run")
    assert (profile.slot_threads, profile.node_cores) == (4, 8)
    assert profile.data_parallel_speedup([4], "cpu") == 2  # 8 cores hold two slots of 4 threads
