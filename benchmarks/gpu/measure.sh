#!/usr/bin/env bash
# One measurement on the GPU host, after the engine's wheels were unpacked into SITE (see benchmarks/gpu/README.md).
#   bash benchmarks/gpu/measure.sh SITE STEP [ARGS...]     STEP: env | install | long-tail | gen-profile | megatron | grpo | model-sizes | moe | lora-7b | packing | ragged | micro | multi-turn | reshard-profile | gpu-tests | sglang-tests | timeline | advice | report
# Figures and logs go to $OUT (the device tool brings them back).
set -uo pipefail
site=$1 step=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 RAY_memory_monitor_refresh_ms=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import hybridrl_fsdp" 2>/dev/null; then  # editable installs of this checkout, no index needed
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/fsdp -e plugins/vllm \
    -e plugins/megatron -e plugins/sglang > "$OUT/pip-editable.log" 2>&1 || { echo "editable install failed"; tail "$OUT/pip-editable.log"; }
fi
# report_run RUN NAME: the run's report (device timeline, busy fraction: hybridrl report), its plan with the
# GPU's links (hybridrl plan) and the files they read, as one $OUT/NAME.tar.gz (the device tool brings back only a
# few files per call)
report_run() {
  local dir; dir=$(mktemp -d)/$2; mkdir -p "$dir"
  python3 -m hybridrl.cli report "$1" --out "$dir/report" 2>&1 | tail -3
  PYTHONPATH=benchmarks:$PYTHONPATH python3 -m hybridrl.cli plan "$1/config.json" > "$dir/plan.txt" 2>&1  # its reward
  for f in metrics.jsonl spans.jsonl config.json device_map.json; do cp "$1/$f" "$dir/" 2>/dev/null; done
  tar czf "$OUT/$2.tar.gz" -C "$(dirname "$dir")" "$2"
}
case $step in
  env) nvidia-smi -L; python3 -c "import torch, ray, tensordict; print(torch.__version__, torch.cuda.device_count(), ray.__version__)";
       python3 -m hybridrl.cli plugins ;;
  megatron) python3 -m pytest -q -s -p no:cacheprovider tests/megatron/test_gpu.py 2>&1 | tee "$OUT/megatron_gpu.log" ;;
  grpo) backend=${1:-vllm}; shift
        python3 benchmarks/grpo_step.py --backend "$backend" --log "$OUT/grpo_$backend.log" \
          --out "$OUT/grpo_step_$backend${TAG:-}.json" "$@" ;;
  model-sizes)  # the workload at 0.5B/1.5B/3B/7B with the README defaults (or --variant tuned)
        python3 benchmarks/model_sizes.py --out-dir "$OUT" --log-dir "$OUT" "$@" ;;
  moe)  # the Qwen3-MoE shape (2.25B, 0.74B active): ARMS of defaults | measured (rollout routing returned, not
        # replayed) | replay (algorithm.routing_replay); one model build, one run per arm inside BUDGET seconds
        budget=${BUDGET:-580} arms=${ARMS:-defaults,replay,measured}; start=$(date +%s)
        for arm in ${arms//,/ }; do
          left=$(( budget - ($(date +%s) - start) - 5 )); [ "$left" -lt 120 ] && { echo "moe: no time for $arm"; break; }
          case $arm in
            defaults) extra=() ;;
            measured) extra=(--tag routing_measured roles.rollout.return_routing=true roles.rollout.log_probs=true) ;;
            replay) extra=(--tag routing_replay algorithm.routing_replay=true roles.rollout.log_probs=true) ;;
          esac
          python3 benchmarks/model_sizes.py --sizes moe --timeout "$left" --out-dir "$OUT" --log-dir "$OUT" \
            "${extra[@]}" "$@"
        done ;;
  lora-7b)  # the 7B shape with the README defaults plus roles.actor.lora (add roles.actor.lora.sync=adapter)
        python3 benchmarks/model_sizes.py --sizes 7b --variant lora --budget 585 --timeout 580 --out-dir "$OUT" \
          --log-dir "$OUT" "$@" ;;
  packing|ragged)  # packed against padded micro-batches on the FSDP engine (one process, no rollout)
        if [ "$step" = ragged ]; then size=${1:-0.5b}; workload=ragged; shift $(( $# < 1 ? $# : 1 ))
        else size=${1:-0.5b}; workload=${2:-ragged}; shift $(( $# < 2 ? $# : 2 )); fi
        python3 benchmarks/packing_step.py --size "$size" --workload "$workload" \
          --out "$OUT/packing_step_${size}_${workload}.json" "$@" 2>&1 | tee "$OUT/packing_step_${size}_${workload}.log" ;;
  gen-profile)  # where vLLM's generation time goes at the standard step's shape, per engine setting
        python3 benchmarks/gen_profile.py --out "$OUT/gen_profile_${SIZE:-0.5b}.json" --size "${SIZE:-0.5b}" "$@" \
          2>&1 | tee "$OUT/gen_profile.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" ;;
  install) ;;  # only the editable installs above (do it once before running steps side by side)
  micro) python3 benchmarks/vllm_rollout.py --parts micro --out "$OUT/${TAG:-vllm}_rollout.json" --log-dir "$OUT/${TAG:-vllm}" "$@" ;;
  multi-turn) python3 benchmarks/multi_turn.py --backend "${BACKEND:-vllm}" --shape qwen0.5b \
          --out "$OUT/multi_turn_${BACKEND:-vllm}${TAG:-}.json" "$@" 2>&1 | tee "$OUT/multi_turn_${BACKEND:-vllm}.log" ;;
  reshard-profile) python3 benchmarks/reshard_profile.py --out "$OUT/reshard_profile${TAG:-}.json" "$@" ;;
  gpu-tests) python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/vllm/test_copy_plan.py tests/fsdp/test_fsdp_cuda.py tests/fsdp/test_fsdp_lora.py \
          tests/fsdp/test_packing_benchmark.py tests/fsdp/test_offload.py tests/fsdp/test_layer_kernels.py \
          tests/e2e/test_out_of_memory.py tests/core/test_memory_meter.py tests/core/test_fractional.py "$@" 2>&1 | tee "$OUT/gpu_tests.log" ;;
  sglang-tests)  # one pytest per file: a run cut short by the device's time still reports the first file's failures
          for f in ${FILES:-tests/sglang/test_sglang_engine.py tests/sglang/test_sglang_kit.py tests/sglang/test_sglang_train.py}; do
            python3 -m pytest -q -s -p no:cacheprovider -rfE "$f" "$@"
          done 2>&1 | tee "$OUT/sglang_tests.log" ;;
  timeline)  # one GRPO run with the README defaults (model_sizes.py): its device timeline and busy fraction
        # (hybridrl report), and its plan with the GPU's links (hybridrl plan)
        rm -rf /tmp/timeline
        python3 benchmarks/model_sizes.py --workdir /tmp/timeline --out-dir "$OUT" --log-dir "$OUT" "$@"
        for run in /tmp/timeline/run-*; do report_run "$run" "$(basename "$run")"; done ;;
  advice)  # the advisor's predicted steps against measured ones on this GPU (benchmarks/advice_validation.py): the
        # config profiled as given, then each map of --maps; the profile run's timeline (report_run; REPORT=0: none).
        # With --reuse, the runs an earlier call left in /tmp/advice are read, not trained again.
        [[ " $* " == *" --reuse "* ]] || rm -rf /tmp/advice
        python3 benchmarks/advice_validation.py --out "$OUT/advice_validation.json" --workdir /tmp/advice "$@"
        [ "${REPORT:-1}" != 0 ] && [ -d /tmp/advice/profile ] && report_run /tmp/advice/profile advice_profile ;;
  long-tail)  # reasoning-length GRPO steps, one arm per scheduling mode (benchmarks/long_tail.py); REPORT=1 also
        # draws each arm's timeline (report_run)
        python3 benchmarks/long_tail.py --out-dir "$OUT" --log-dir "$OUT" "$@"
        [ -n "${REPORT:-}" ] && for run in /tmp/long-tail/run-*; do report_run "$run" "$(basename "$run")"; done ;;
  report)  # an earlier call's run folder, drawn now (report_run): RUN NAME
        report_run "$1" "$2" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
