"""Run configuration: YAML plus dotted overrides, validated into typed models before any process starts.

Every problem is reported with its key path (``roles.rollout.backend: unknown rollout backend 'vlm' ...``),
and all problems are reported at once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybridrl.errors import HybridRLError


class ConfigError(HybridRLError, ValueError):
    """One or more config problems; ``problems`` holds ``(key path, reason)`` pairs."""

    exit_status = 2  # refused before any work

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  {path or '<root>'}: {reason}" for path, reason in problems)
        super().__init__(f"invalid config ({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n{lines}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TinyModelConfig(Strict):
    """A small Qwen2 (or, with ``num_experts``, a Qwen3-MoE) built from this config (no download), with the bundled
    character tokenizer."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(256, gt=0)
    max_position: int = Field(128, gt=0)
    seed: int = 0
    init_std: float = Field(0.02, gt=0, description="std of the random weights (HF initializer_range): the tied "
                                                   "output head's size, which caps the logits of a frozen base")
    tokenizer: str = Field("char", min_length=1, description="char: the bundled character tokenizer; char_chat: "
                                                             "it with role tokens and a chat template; or a folder "
                                                             "holding a saved tokenizer (its vocabulary sizes the "
                                                             "model)")
    num_experts: int = Field(0, ge=0, description="0: a dense Qwen2; more: a Qwen3-MoE with this many routed "
                                                  "experts in every layer (docs/moe.md)")
    experts_per_token: int = Field(2, gt=0, description="with num_experts: the experts each token is routed to "
                                                        "(top-k)")
    moe_intermediate_size: int | None = Field(None, gt=0, description="with num_experts: each expert's MLP width "
                                                                      "(default: intermediate_size / "
                                                                      "experts_per_token)")

    @model_validator(mode="after")
    def _experts(self) -> TinyModelConfig:
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}")
        return self

    @property
    def expert_size(self) -> int:
        """Each expert's MLP width (``moe_intermediate_size``, else the dense width split over the top-k)."""
        return self.moe_intermediate_size or max(1, self.intermediate_size // self.experts_per_token)


class ModelConfig(Strict):
    path: str | None = None
    tiny: TinyModelConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of model.path (an HF checkpoint folder) or model.tiny")
        return self


class DataConfig(Strict):
    train: str | None = Field(None, description="jsonl or parquet file of prompts")
    dataset: str | None = Field(None, description="name of a registered dataset instead of a file")
    dataset_args: dict[str, Any] = Field(default_factory=dict)
    val: str | None = Field(None, description="jsonl or parquet file of validation prompts (same formats)")
    val_dataset_args: dict[str, Any] | None = Field(None, description="with data.dataset: the arguments that give "
                                                                      "its validation rows")
    prompt_key: str = Field("prompt", description="the field holding the prompt: text or {role, content} messages "
                                                  "(a dotted path reaches nested fields)")
    answer_key: str | None = Field(None, description="the field holding the reference answer (default: the first of "
                                                     "reward_model.ground_truth, ground_truth, answer, solution)")
    data_source_key: str = Field("data_source", description="the field naming each row's source (reward dispatch "
                                                            "by roles.reward.by_source, per-source metrics)")
    chat_template: str = Field("auto", min_length=1, description="auto: message prompts get the tokenizer's chat "
                                                                 "template with the generation prompt; none: no "
                                                                 "template; or a Jinja template file")
    system_prompt: str | None = Field(None, description="a system message prepended to every chat (a text "
                                                        "prompt then becomes a user message)")
    max_prompt_len: int = Field(512, gt=0)
    long_prompts: Literal["error", "drop"] = "error"
    prompts_per_step: int = Field(32, gt=0)
    shuffle: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.train is None) == (self.dataset is None):
            raise ValueError("give exactly one of data.train (a file) or data.dataset (a registered name)")
        if self.chat_template == "none" and self.system_prompt is not None:
            raise ValueError("data.system_prompt needs a chat template: data.chat_template is none")
        if self.val is not None and self.val_dataset_args is not None:
            raise ValueError("give at most one of data.val (a file) or data.val_dataset_args")
        if self.val_dataset_args is not None and self.dataset is None:
            raise ValueError("data.val_dataset_args needs data.dataset (the registered dataset it is passed to)")
        return self


class KLConfig(Strict):
    coef: float = Field(0.001, ge=0, description="KL coefficient (the initial one for the adaptive controller)")
    estimator: str = "k3"
    apply_as: Literal["loss", "reward"] = Field("loss", alias="as")
    controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: Ziegler-style controller steering the KL in the reward towards target")
    target: float | None = Field(None, gt=0, description="adaptive: target KL per sequence (nats, summed over tokens)")
    horizon: float = Field(10000, gt=0, description="adaptive: sequences over which the coefficient may move by ~20%")

    @model_validator(mode="after")
    def _adaptive_needs_target(self) -> KLConfig:
        if self.controller == "adaptive":
            if self.target is None:
                raise ValueError("kl.controller=adaptive needs kl.target (KL per sequence, in nats)")
            if self.apply_as != "reward":
                raise ValueError("kl.controller=adaptive steers a KL penalty in the reward: set kl.as=reward")
        return self


class OverlongConfig(Strict):
    """What a truncated response (it reached ``roles.rollout.max_new_tokens`` without stopping) does to the loss.

    Given as a word (``overlong: mask``) or a mapping (``overlong: {mode: penalty, buffer: 256}``)."""

    mode: Literal["keep", "mask", "penalty"] = Field(
        "keep", description="keep: trained like any response; mask: left out of the actor's loss (its score still "
                            "counts in its group's baseline; DAPO's overlong filtering); penalty: DAPO's soft "
                            "length penalty, added to the score")
    buffer: int | None = Field(None, gt=0, description="penalty: the last `buffer` tokens before max_new_tokens, over "
                                                       "which the penalty grows linearly from 0 to max_penalty")
    max_penalty: float = Field(1.0, ge=0, description="penalty: what a response of max_new_tokens loses")

    @model_validator(mode="before")
    @classmethod
    def _word(cls, value: Any) -> Any:
        return {"mode": value} if isinstance(value, str) else value


class ResponseLengthsConfig(Strict):
    """Forced response lengths, for benchmarks of long-tailed generation: each sample's length is drawn from a
    lognormal (seeded by the prompt's place in the data order and the sample, so every run and arm gets the same
    lengths), capped at ``roles.rollout.max_new_tokens``; set ``roles.rollout.ignore_eos`` with it."""

    median: int = Field(gt=0, description="the lognormal's median, in tokens")
    sigma: float = Field(1.0, ge=0, description="the lognormal's sigma (the log of the lengths' spread)")
    seed: int = Field(0, description="seed of the lengths (not of the sampling)")


class AlgorithmConfig(Strict):
    name: str = "grpo"
    n_samples: int = Field(8, gt=0)
    advantage: str | None = None  # default: from the algorithm preset
    policy_loss: str | None = None
    loss_agg: str | None = None
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    norm_adv_by_std: bool = True
    entropy_coef: float = 0.0
    epochs: int = Field(1, gt=0, description="passes over each batch (PPO epochs)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (GAE, REINFORCE++)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda")
    critic_warmup: int = Field(0, ge=0, description="first steps in which only the critic is trained")
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling: the policy loss of each token is weighted by "
                                "min(pi_old / pi_rollout, tis_cap), correcting for rollout weights that lag the "
                                "trainer (trainer.pipelined) or an engine that computes differently; null: off "
                                "(a pipelined run defaults to 2.0)")
    kl: KLConfig | None = Field(default_factory=KLConfig)
    filter_groups: bool = Field(
        False, description="dynamic sampling (DAPO): drop a prompt's group when all its samples score the same (its "
                           "advantages are all zero) and generate more prompts until the step holds "
                           "data.prompts_per_step groups")
    max_refills: int = Field(8, ge=0, description="filter_groups: extra prompt batches a step may generate; a step "
                                                  "they cannot fill stops the run")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig,
                                     description="truncated responses: keep | mask | {mode: penalty, buffer, "
                                                 "max_penalty}")
    old_log_probs: Literal["auto", "recompute"] = Field(
        "auto", description="auto: skip the actor's old-log-prob pass where it provably equals the update's own "
                            "log-probs (one optimizer step per batch, KL not folded into the reward)")
    routing_replay: bool = Field(
        False, description="MoE routing replay: the actor routes each response token to the experts the rollout "
                           "routed it to (router weights still from the actor's logits), so its log-probs and "
                           "importance ratios are those of the sampling engine's routing (docs/moe.md)")
    options: dict[str, Any] = Field(default_factory=dict)


class PoolConfig(Strict):
    nodes: int = Field(1, gt=0)
    devices_per_node: int = Field(1, gt=0)
    share: str | None = Field(
        None, description="fractional devices: the pool whose devices this one runs on too (same nodes x "
                          "devices_per_node). Both pools are resident at once, not time-shared: the memory plan "
                          "splits each device between them, and weights cross by CUDA IPC (docs/long-tail.md)")
    per_device: int = Field(
        1, ge=1, description="processes of this pool on each of its devices: independent rollout replicas side by "
                             "side on one GPU, each with its share of the requests and of the memory; a "
                             "rollout-only pool (measured: docs/long-tail.md)")

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node


class RoleBase(Strict):
    pool: str | None = None
    backend: str | None = None
    options: dict[str, Any] = Field(default_factory=dict, description="backend-specific settings")


class LoraConfig(Strict):
    """LoRA adapters on the actor (``hybridrl.lora``): only the adapters and their optimizer state are trained,
    the base weights stay frozen, and the reference is the base with the adapters disabled."""

    rank: int = Field(16, gt=0, description="the adapters' rank r")
    alpha: float | None = Field(None, gt=0, description="scaling numerator: the update is alpha / rank * B A "
                                                        "(default: 2 x rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    target_modules: str | list[str] = Field(
        "all-linear", description="the linear layers that get adapters: module names (q_proj, v_proj ...) or "
                                  "all-linear (every linear layer of the decoder, not the output head)")
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="what a weight sync sends: adapter (only the adapters; the rollout engine serves them), "
                            "merged (the trainer merges them into full weights), auto (merged when actor and "
                            "rollout share a process, else adapter)")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            if value != "all-linear":
                raise ValueError(f"a list of module names or 'all-linear', got '{value}'")
            return value
        if not value or any(not isinstance(v, str) or not v.strip() for v in value):
            raise ValueError("give at least one module name (q_proj, v_proj ...) or 'all-linear'")
        return value


class ActorConfig(RoleBase):
    backend: str | None = "fsdp"
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch: int = Field(16, gt=0, description="sequences per forward/backward on one rank")
    mini_batch: int | None = Field(None, gt=0, description="sequences per optimizer step (default: the whole batch)")
    warmup_steps: int = Field(0, ge=0)
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="token budget per micro-batch (rows binned by real length; replaces micro_batch)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of the full weights")


class RefConfig(RoleBase):
    backend: str | None = None  # default: the actor's
    micro_batch: int | None = Field(None, gt=0, description="default: the actor's")
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="default: the actor's")


class CriticConfig(RoleBase):
    """The value model (PPO): the actor's backbone (or ``model_path``) with a scalar head. Placed only when
    the algorithm's advantage estimator needs values; unset keys fall back to the actor's."""

    backend: str | None = "fsdp"
    model_path: str | None = Field(None, description="HF checkpoint of the backbone (default: the actor's model)")
    lr: float | None = Field(None, gt=0, description="default: the actor's lr")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch: int | None = Field(None, gt=0, description="default: the actor's")
    mini_batch: int | None = Field(None, gt=0, description="default: the actor's")
    warmup_steps: int = Field(0, ge=0)
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="default: the actor's")
    cliprange_value: float | None = Field(0.5, gt=0, description="value clipping around the old values (null: off)")
    loss_agg: str = Field("token-mean", description="a registered loss aggregation for the value loss")


class RolloutConfig(RoleBase):
    backend: str | None = "hf"
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    tensor_parallel: int = Field(1, gt=0)
    log_probs: bool | Literal["auto"] = Field(
        "auto", description="the engine returns the sampled tokens' log-probs; auto: only when something reads them "
                            "(truncated importance sampling, a component that declares it needs them), since they "
                            "cost the engine a log-softmax per sampled token; true also logs rollout/logp_diff")
    return_routing: bool | Literal["auto"] = Field(
        "auto", description="MoE: the engine returns the experts each response token was routed to (routed_experts); "
                            "auto: on with algorithm.routing_replay; true without replay logs moe/routing_mismatch")
    oversample: float = Field(
        1.0, ge=1, description="prompt groups in flight per step, as a multiple of data.prompts_per_step: a step "
                               "trains the first data.prompts_per_step groups to complete and the rest stay in "
                               "flight, so no step waits for its longest response (docs/long-tail.md); 1: every group "
                               "completes")
    partial: bool | Literal["auto"] = Field(
        "auto", description="partial rollouts: a sample still generating when its step has its groups keeps its tokens "
                            "and resumes under the next step's weights (tokens at most trainer.max_staleness updates "
                            "old); false: its group is dropped (which favours short responses); auto: on when "
                            "oversample > 1 or refill is on, and the backend declares `partial`")
    refill: bool | Literal["auto"] = Field(
        False, description="keep oversample x prompts_per_step groups decoding: each group that completes mid-step "
                           "lets a new prompt's group start at once, so the engine's batch never empties into a tail "
                           "of a few long rows (backends that declare `refill`: hf, vllm); auto: on when oversample > "
                           "1 and the backend declares it. Off by default: measured no faster with vLLM at 0.5B "
                           "(benchmarks/README.md)")
    response_lengths: ResponseLengthsConfig | None = Field(
        None, description="benchmarks: force each sample's response length, drawn from a lognormal {median, sigma, "
                          "seed} capped at max_new_tokens (with ignore_eos)")
    bucket_mb: float = Field(64.0, gt=0)
    weight_transport: Literal["auto", "in_process", "broadcast", "object_store", "cuda_ipc"] = Field(
        "auto", description="how actor weights reach the rollout; auto follows the placement (cuda_ipc between "
                            "pools sharing GPUs)")


class RewardModelConfig(Strict):
    """A reward model: ``AutoModelForSequenceClassification`` with one label, scoring prompt+response. It
    must share the policy's tokenizer (token ids are passed as they are)."""

    path: str | None = Field(None, description="HF checkpoint folder of a sequence-classification model")
    tiny: TinyModelConfig | None = Field(None, description="build a small random one from this config (tests)")
    coef: float = Field(1.0, description="weight of the model's score in the reward")
    micro_batch: int | None = Field(None, gt=0, description="default: the actor's")

    @model_validator(mode="after")
    def _one_source(self) -> RewardModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of roles.reward.model.path or roles.reward.model.tiny")
        if self.tiny is not None and self.tiny.num_experts:
            raise ValueError("roles.reward.model.tiny.num_experts: the tiny reward model is a dense Qwen2 "
                             "classifier (leave num_experts at 0)")
        return self


class RewardTerm(Strict):
    """One weighted rule reward of a sum: ``{fn: format, weight: 0.1, args: {pattern: '####'}}``."""

    fn: str = Field(min_length=1, description="a registered reward name or module:function")
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments the reward is called with")


#: a rule reward: one name (``gsm8k``, ``module:function``) or a weighted sum of terms.
RewardSpec = str | list[str | RewardTerm]


class HttpRewardConfig(Strict):
    """How ``roles.reward.url`` is called: batched JSON POSTs, retried, each with a timeout."""

    batch_size: int = Field(64, gt=0, description="responses per POST")
    retries: int = Field(2, ge=0, description="further tries of a POST that failed (connection, 5xx, timeout)")
    timeout_s: float = Field(60.0, gt=0, description="seconds per POST")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry, doubled for each next one")
    coef: float = Field(1.0, description="weight of the service's score in the reward")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers of each POST (Authorization: "
                                                                       "Bearer ${TOKEN}); their values are redacted "
                                                                       "in config.json and in logs")


class RewardConfig(RoleBase):
    fn: RewardSpec | None = Field("reverse", description="a rule reward: a registered name or module:function, "
                                                         "or a list of {fn, weight, args} summed; null: none")
    by_source: dict[str, RewardSpec] = Field(default_factory=dict, description="data_source -> rule reward; "
                                                                               "other sources get fn")
    runner: Literal["auto", "inline", "process"] = Field(
        "auto", description="where rule rewards run: process (a pool with a timeout per call), inline (in the "
                            "driver's process: a user function's call past timeout_s is left on its thread), auto "
                            "(inline for the bundled trivial rewards, else process)")
    workers: int | None = Field(None, gt=0, description="processes of the reward pool (default: min(4, CPUs))")
    timeout_s: float = Field(10.0, gt=0, description="seconds one rule-reward call may take (the pool, a user "
                                                     "function inline, the pre-flight probe)")
    max_failed_fraction: float = Field(0.5, ge=0, le=1, description="stop the run when more than this share of a "
                                                                    "batch's rewards raise, hang or return no number")
    max_consecutive_failures: int = Field(
        32, ge=0, description="stop the run when this many rule-reward calls in a row fail the same way (time out, "
                              "raise or return no number, or end their process), rather than pay the timeout for "
                              "every response; 0: never")
    url: str | None = Field(None, description="a reward service: responses POSTed in batches, scores returned")
    http: HttpRewardConfig = Field(default_factory=HttpRewardConfig)
    model: RewardModelConfig | None = None

    @model_validator(mode="after")
    def _some_reward(self) -> RewardConfig:
        if self.by_source and "fn" not in self.model_fields_set:
            self.fn = None  # with a dispatch table, a source outside it has no reward unless fn is given
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"roles.reward.url must start with http:// or https://, got '{self.url}'")
        # that some reward is given (these, or an environment's own) is checked by RunConfig, which sees both
        if self.model is None and self.pool is not None:
            raise ValueError("roles.reward.pool places a reward model: set roles.reward.model too "
                             "(rule rewards run in the driver)")
        if self.model is not None and self.backend is None:
            self.backend = "fsdp"
        return self


class RolesConfig(Strict):
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig | None = Field(default_factory=RefConfig)
    critic: CriticConfig | None = Field(None, description="default: placed with the actor when the algorithm needs it")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)


class ClusterConfig(Strict):
    address: str | None = Field(None, description="Ray address to join; default: RAY_ADDRESS, else a local Ray")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nodes: int | None = Field(None, gt=0, description="declare the cluster instead of asking Ray (for plans)")
    devices_per_node: int | None = Field(None, gt=0)
    max_colocate_count: int = Field(1, gt=0, description="processes allowed per device")
    device_memory_gb: float | None = Field(
        None, gt=0, description="GiB per device, for the plan's memory estimate (default 80 on cuda)")
    host_memory_gb: float | None = Field(
        None, gt=0, description="GiB of host memory per node, for the plan's host line (offloaded state, a rollout "
                                "asleep; default: this machine's for a run on it)")
    threads_per_worker: int | None = Field(None, gt=0)


class TrainerConfig(Strict):
    steps: int = Field(100, gt=0)
    out: str = "runs/default"
    seed: int = 0
    trackers: list[str] = Field(default_factory=lambda: ["console", "jsonl"])
    log_every: int = Field(1, gt=0)
    log_samples: int = Field(4, ge=0, description="sample responses written to <out>/samples.jsonl per logged step")
    profile_step: int = Field(0, ge=0, description="profile the engine calls of profile_calls in this step (0: none): "
                                                   "their top kernels in <out>/profile/")
    profile_calls: list[str] = Field(default_factory=lambda: ["actor.update"],
                                     description="role.method names of the engine calls to profile")
    progress: bool = Field(True, description="a progress bar, drawn only when standard error is a terminal")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps and at the last step (0: never; Ctrl-C "
                                                 "still saves one)")
    keep_checkpoints: int = Field(2, ge=0, description="complete checkpoints kept, newest first (0: all)")
    resume: str = Field("auto", min_length=1, description="auto: from the latest checkpoint in trainer.out, if any; "
                                                          "never; or a checkpoint / run folder")
    resume_unverified: bool = Field(False, description="resume from a checkpoint that has no manifest.json (its "
                                                       "files cannot be checked against what was saved), or one "
                                                       "saved before checkpoints held plain data only; off: such "
                                                       "a checkpoint is refused (auto passes over it)")
    max_bad_steps: int = Field(3, ge=0, description="stop after this many steps in a row whose update was skipped "
                                                    "(non-finite loss or gradient); 0: never stop")
    step_timeout_s: float | Literal["auto"] = Field(
        "auto", description="seconds the driver waits for a worker's answer (a stopped, deadlocked or hung worker is "
                            "named and the run stops); auto: 1800 until a step has finished (start-up, first step), "
                            "then 10 x the slowest step so far, at least 600 (docs/deadlines-and-cluster.md)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every step generates, then trains on its own samples; async: generation does not "
                            "wait for the trainer, on any map: with the rollout alone on its pool it generates the "
                            "next step while this one trains (trainer.pipelined), colocated a step's generation stops "
                            "once its groups are complete and the rest resume under the next weights (groups in "
                            "flight, roles.rollout.oversample 1.25 unless set); tokens at most trainer.max_staleness "
                            "updates old (docs/long-tail.md)")
    pipelined: bool = Field(False, description="generate the next step's batch while this step trains (actor and "
                                               "rollout on different pools); trainer.mode=async chooses it where "
                                               "the map allows")
    sync_every: int = Field(1, ge=1, description="pipelined: send the actor's weights to the rollout every N updates "
                                                 "(at most trainer.max_staleness); 1: every update, so a batch is "
                                                 "one update old")
    max_staleness: int = Field(1, ge=1, description="pipelined and partial rollouts: at most this many actor updates "
                                                    "between the weights that sampled a token and the weights it "
                                                    "trains against (an older partial sample starts again)")
    sync_check_every: int = Field(0, ge=0, description="every N steps, check that the rollout's greedy tokens are the "
                                                       "actor's argmax after the weight sync "
                                                       "(hybridrl.weights.sync_check; 0: never; synchronous steps "
                                                       "only)")

    val_every: int = Field(0, ge=0, description="validate on data.val every N steps (0: only before training, "
                                                "with val_before_train, and after the last step)")
    val_before_train: bool = Field(True, description="validate once before the first step (with data.val)")
    val_n: int = Field(1, gt=0, description="responses per validation prompt (pass@k, mean@k over them)")
    val_temperature: float = Field(0.0, ge=0, description="sampling temperature of validation (0: greedy)")
    val_pass_threshold: float = Field(1.0, description="a validation response passes (pass@k) at this score or more")
    keep_best: str | None = Field(None, description="a validation metric (val/reward/mean ...): keep the checkpoint "
                                                    "that scored best on it in <out>/best")
    keep_best_mode: Literal["max", "min"] = "max"

    @model_validator(mode="after")
    def _mode_and_pipelined_agree(self) -> TrainerConfig:
        if self.pipelined and self.mode == "sync" and "mode" in self.model_fields_set:
            raise ValueError("trainer.pipelined=true generates ahead of the trainer, which is trainer.mode=async; "
                             "set one of them, not pipelined=true with mode=sync")
        if self.pipelined:
            self.mode = "async"
        if self.sync_every > self.max_staleness:
            raise ValueError(f"trainer.sync_every={self.sync_every} exceeds trainer.max_staleness="
                             f"{self.max_staleness}: a batch would be generated by weights older than the bound "
                             "allows; lower sync_every or raise max_staleness")
        return self

    @field_validator("step_timeout_s")
    @classmethod
    def _positive_timeout(cls, value: float | str) -> float | str:
        if value != "auto" and not float(value) > 0:
            raise ValueError("expected auto or a number of seconds > 0")
        return value

    @field_validator("trackers")
    @classmethod
    def _jsonl_always(cls, value: list[str]) -> list[str]:
        return value if "jsonl" in value else [*value, "jsonl"]

    @field_validator("profile_calls")
    @classmethod
    def _calls_name_a_role(cls, calls: list[str]) -> list[str]:
        from hybridrl.roles import ROLES

        for name in calls:
            role, _, method = name.partition(".")
            if role not in ROLES or not method.isidentifier():
                raise ValueError(f"'{name}' is not role.method with a role of {', '.join(ROLES)} "
                                 "(e.g. actor.update, ref.compute_log_probs)")
        return calls


class EnvironmentConfig(Strict):
    """Episodes (``hybridrl.environments``): one generation per prompt by default; a multi-turn environment
    answers each model turn (tool results ...) and one row per trajectory is trained on the model's tokens."""

    name: str = Field("single_turn", min_length=1, description="a registered environment: single_turn (one "
                                                               "generation, today's path), tools, calc, or a plugin's")
    options: dict[str, Any] = Field(default_factory=dict, description="the environment's own options")
    max_turns: int = Field(1, gt=0, description="model turns per episode at most")
    max_total_tokens: int | None = Field(
        None, gt=0, description="tokens after the prompt per episode at most, model and observation tokens together "
                                "(the trained rows' response width); default max_turns * roles.rollout.max_new_tokens")
    tools: list[str] = Field(default_factory=list, description="registered tools the episodes may call "
                                                                "(calculator, python ...)")
    tool_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per tool, by name; python: isolation (bwrap, the default: Linux "
                                          "namespaces through bubblewrap, refused where it does not work; http: a "
                                          "SandboxFusion run_code service at url; none: rlimits only, unconfined, "
                                          "printed as a warning), url, network, timeout_s, cpu_s, memory_mb, "
                                          "file_mb, disk_mb, processes ... (docs/sandbox.md)")
    tool_deadline_s: float = Field(60.0, gt=0, description="seconds a tool call may take before the episode's call "
                                                           "is failed as timed out (counted in env/tool_timeouts); "
                                                           "the step never waits longer")
    tool_parser: str | None = Field("hermes", description="a registered tool-call parser (hermes: <tool_call> JSON)")
    plain_template: str = Field("{content}", description="how an observation message is written when there is no "
                                                         "chat template ({role}, {name}, {content})")
    mode: Literal["auto", "batched", "requests"] = Field(
        "auto", description="requests: one engine request per turn of each episode (vLLM, SGLang); batched: one "
                            "generate call per round of turns (any engine); auto: requests where the engine can")
    env_workers: int = Field(8, gt=0, description="threads stepping environments (requests mode)")


def keyed_error(path: str, message: str) -> PydanticCustomError:
    """An error of a whole-config rule reported at the key it is about (a root validator's own location is the
    top level, which names nothing)."""
    return PydanticCustomError("keyed", message, {"path": path})


class RunConfig(Strict):
    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    pools: dict[str, PoolConfig] = Field(default_factory=lambda: {"default": PoolConfig()})
    roles: RolesConfig = Field(default_factory=RolesConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    plugins: list[str] = Field(default_factory=list, description="extra plugin modules to load")
    auto: dict[str, Any] = Field(default_factory=dict, description="written by the pre-flight: what each auto setting "
                                                                   "resolved to and why, and the planned memory per "
                                                                   "phase (a value given here is replaced)")

    @model_validator(mode="after")
    def _some_reward(self) -> RunConfig:
        reward = self.roles.reward
        if (reward.fn is None and reward.model is None and reward.url is None and not reward.by_source
                and self.environment.name == "single_turn"):
            raise keyed_error("roles.reward", "give roles.reward.fn (a rule reward), roles.reward.by_source, "
                              "roles.reward.url, roles.reward.model, or several (or an environment whose episodes "
                              "reward themselves, environment.name)")
        return self

    @model_validator(mode="after")
    def _shared_pools(self) -> RunConfig:
        for name, pool in self.pools.items():
            if pool.share is None:
                continue
            host = self.pools.get(pool.share)
            key = f"pools.{name}.share"
            if pool.share == name:
                raise keyed_error(key, "a pool cannot share its own devices")
            if host is None:
                raise keyed_error(key, f"unknown pool '{pool.share}' (pools: {', '.join(self.pools)})")
            if host.share is not None:
                raise keyed_error(key, f"pool '{pool.share}' itself shares pool '{host.share}': name that one")
            if (host.nodes, host.devices_per_node) != (pool.nodes, pool.devices_per_node):
                raise keyed_error(key, f"pool '{name}' is {pool.nodes}x{pool.devices_per_node} and pool "
                                       f"'{pool.share}' {host.nodes}x{host.devices_per_node}: a pool sharing "
                                       "devices has the same nodes and devices_per_node")
        return self

    def rollout_returns_routing(self) -> bool:
        """Whether the rollout is asked for ``routed_experts`` (``roles.rollout.return_routing``; auto: with
        ``algorithm.routing_replay``). An engine that records routing at start (vLLM) reads it from its options."""
        value = self.roles.rollout.return_routing
        return self.algorithm.routing_replay if value == "auto" else bool(value)

    def role_configs(self) -> dict[str, RoleBase]:
        """The enabled roles that run on a pool (the reward role only when it has a model: rule rewards run
        in the driver)."""
        out: dict[str, RoleBase] = {}
        for name in type(self.roles).model_fields:
            cfg = getattr(self.roles, name)
            if cfg is not None and (name != "reward" or cfg.model is not None):
                out[name] = cfg
        return out
