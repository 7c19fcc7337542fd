"""Configuration of the GRPO learner: one dataclass per component, every field documented.

`LossConfig` (the GRPO objective), `OptimConfig` (AdamW), `TrainerConfig` (training forward,
publishing, checkpoints), `RolloutConfig` (how episodes are generated), `PipelineConfig`
(scheduling of rollouts against training) and `RayConfig` (rollout actors on Ray).
`RunConfig` only groups them for one run. Nothing here runs anything; defaults follow the
issue (G = 8, eps 0.2 / 0.28, staleness 2, replay on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any


@dataclass
class LossConfig:
    eps_low: float = 0.2            # ratio clipped below at 1 - eps_low (negative advantages)
    eps_high: float = 0.28          # ratio clipped above at 1 + eps_high (DAPO clip-higher)
    ratio_cap: float = 3.0          # importance ratio vs behaviour truncated at this (dual clip):
                                    # bounds the push on tokens the policy now likes far more
    normalize_std: bool = False     # divide group-centred rewards by the group's std
    kl_coef: float = 0.0            # weight of a k3 KL penalty to the initial weights (0 = off,
                                    # and no reference model is kept)
    negatives: str = "all"          # the tokens a negative advantage trains: "all", or
                                    # "decision": those up to the first call's tool name
                                    # (`TrainSample.decision`; samples without one: all)
    balance: bool = False           # the disliked side of a step weighs what the liked side
                                    # does: negative-advantage tokens' weights scaled so their
                                    # sum of |advantage| x weight equals the positive tokens'
                                    # (`balance_scale`; KTO's class weights)
    unlikelihood: float = 0.0       # weight of -log(1 - p) on the tokens of a degenerate
                                    # loop a call was cut off in (`TrainSample.loop`; 0 = off)
    guided_failures: bool = True    # a guided group's failures train (pushed down below its
                                    # guide, `RolloutConfig.guide`); False: only the guide trains
    guide_weight: float = 1.0       # weight of an off-policy (guide) token's term
    guide_shaping: float = 0.0      # gamma of LUFFY's policy shaping on off-policy tokens: the
                                    # term is A * p / (p + gamma) (gradient A * gamma p /
                                    # (p + gamma)^2 d log p, largest at p = gamma, small for
                                    # tokens the policy already writes or finds absurd);
                                    # 0: A * ratio at ratio 1 (gradient A d log p, SFT's)


@dataclass
class OptimConfig:
    lr: float = 1e-6                # AdamW learning rate (constant)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates
    eps: float = 1e-8               # AdamW denominator epsilon
    weight_decay: float = 0.0       # decoupled weight decay
    grad_clip: float = 1.0          # max global gradient norm (0 = no clipping)


@dataclass
class TrainerConfig:
    loss: LossConfig = field(default_factory=LossConfig)      # the GRPO objective
    optim: OptimConfig = field(default_factory=OptimConfig)   # the optimizer
    router_replay: bool = True      # force the recorded expert choices in the training forward
    temperature: float = 1.0        # temperature the rollouts sample at; training logprobs are
                                    # recomputed under it (0 = greedy rollouts, logprobs at 1)
    publish_dtype: str = "bfloat16" # dtype of published policy versions (masters stay fp32)
    checkpoint_every: int = 1       # write a resumable checkpoint every N steps
    keep_checkpoints: int = 2       # newest checkpoints kept on disk
    device: str = "cpu"             # where the fp32 master model trains
    precision: str = "fp32"         # "fp32", "bf16" (forward and backward on a bf16 copy of the
                                    # fp32 masters: `learner.precision`) or "auto" (bf16 where
                                    # the hardware has native bf16 matmuls); the GRPO stage and
                                    # the online learner use "auto"
    seed: int = 0                   # torch seed at the start of a fresh run
    micro_batch_tokens: int = 8192  # positions fed per training forward and backward (a
                                    # shared prefix once; rows x longest row at most twice it,
                                    # attention's share): bounds activation memory; a longer
                                    # sample goes alone. The gradient does not depend on it
    share_rows: bool = True         # the calls of one conversation share a row of the training
                                    # forward (fed once, scored per call); off: a row per call
    share_prefixes: bool = True     # rows that start with the same tokens and routes (a GRPO
                                    # group's episodes) feed that prefix once: one packed prefix
                                    # tree, attention along each row (`Trainer.forward_batch`)
    trainable: tuple[str, ...] = () # regexes of the parameter names that train (`re.search`);
                                    # the others stay as loaded. Empty: all of them
    iterations: int = 1             # optimizer steps on each batch (GRPO's mu, TRL's
                                    # num_iterations, veRL's ppo_epochs): every pass after the
                                    # first scores the same samples with the weights the last
                                    # one left, the ratio to their behaviour logprobs clipped as
                                    # in the first; one version published per batch


@dataclass
class RolloutConfig:
    group_size: int = 8             # G: episodes per task, compared with each other
    concurrency: int = 8            # episodes of a group in flight at once
    max_new_tokens: int = 512       # per model call
    max_steps: int = 20             # model calls per episode (agent tasks)
    dtype: str = "bfloat16"         # dtype of the rollout policies' weights
    device: str = "cpu"             # where the rollout policies run
    workers: int = 1                # rollout workers, each with its own policy copy (async only)
    processes: bool = True          # async workers are processes (no GIL shared with the
                                    # trainer; weights via shared memory); False: threads
    worker_threads: int = 1         # torch intra-op threads of each worker process
                                    # (rollouts sample the full distribution: no top-p/top-k,
                                    # training logprobs are computed without filtering)
    backend: str = "local"          # async workers: "local" (threads or processes, above) or
                                    # "ray" (Ray actors; see RayConfig)
    partial_credit: float = 0.0     # a failed, honest episode's reward: this times the share
                                    # of the tests it left passing (0: pass/fail only), so a
                                    # group that all fails still ranks what broke less
    oracle_start: float = 0.0       # share of groups that start after some of the oracle's
                                    # turns (uniform over its plan; `tasks.oracle.OracleStart`):
                                    # shorter episodes whose outcome the policy's few calls
                                    # decide. Only tasks with an oracle plan (sim); 0: off
    slip_start: float = 0.0         # share of the other groups that start after a slip: the
                                    # oracle's turns up to one call played with a mistake (a
                                    # search for a name the code lacks, a garbled path or
                                    # `old`; `tasks.oracle.slip_start`), so the policy plays the
                                    # recovery. Sim only; 0: off
    guide: float = 0.0              # share of the groups in which no episode passed that get
                                    # the oracle's episode as one more member (`tasks.oracle.
                                    # GuidePolicy`; LUFFY's off-policy guidance): the group
                                    # then holds a pass its failures rank below. Sim only, groups
                                    # not oracle-started (a slip start's guide plays its plan's
                                    # recovery); 0: off
    stop_after_failed_checks: int = 0  # end an episode at this many failed checks after its
                                    # first change (`learner.rollout.FailedChecks`): of the
                                    # default model's 428 passes in a GRPO run, one had a failed
                                    # check after a change, so what a failure does after one is
                                    # work that teaches nothing (RUNS.md, "Episodes cut at their
                                    # first failed check"). Not guides; 0: off
    check_references: bool = True   # sim episodes' tool calls held to the workspace too
                                    # (`AgentConfig.check_references`: paths that exist, `old`
                                    # text in the file), not only to their form as serving
                                    # holds them: the two GRPO runs whose rollouts were held to
                                    # their form lost fix_import to garbled first turns, the
                                    # four held to the workspace did not, one of them the same
                                    # command as a run that did (RUNS.md, "Which rollouts lose
                                    # fix_import", "`p1` again with rollouts held to ...")


@dataclass
class PipelineConfig:
    mode: str = "async"             # "async": rollouts overlap training; "sync": alternate
    steps: int = 100                # optimizer steps of the whole run (a resumed run counts on)
    groups_per_step: int = 4        # task groups in one training batch
    max_staleness: int = 2          # samples older than newest version - this are dropped; a
                                    # group starts only while fewer than groups_per_step *
                                    # (max_staleness + 1) are queued or running
    torch_threads: int = 0          # torch intra-op threads for the process (0 = leave as is)
    idle_threads: int = 0           # async with worker processes: the trainer's threads while
                                    # no group is queued or rolling out (the workers' cores are
                                    # then idle), `torch_threads` otherwise; 0: off
    seed: int = 0                   # task order and sampling seeds
    curriculum: bool = False        # draw task families where the policy both passes and
                                    # fails (`learner.curriculum`); tasks without a family: off
    revisit: float = 0.0            # with the curriculum: share of a family's draws that rerun
                                    # a task whose last group was mixed (`learner.curriculum`)
    max_skipped: int = 0            # groups whose episodes all got one reward (no advantage,
                                    # nothing to train) set aside per step, so a step trains on
                                    # groups_per_step informative ones (DAPO's dynamic sampling);
                                    # after this many the step takes what comes. 0: off


@dataclass
class RayConfig:
    address: str | None = None      # Ray cluster to join ("auto", "HOST:6379"); None: the one
                                    # this process already joined, else a new local instance
    num_cpus: float = 1.0           # CPUs reserved per rollout actor (one placement bundle each)
    strategy: str = "SPREAD"        # placement group strategy: SPREAD over nodes, or PACK
    max_replacements: int = 3       # dead actors replaced per worker slot before the run fails


@dataclass
class RunConfig:
    model: str = "default"          # checkpoint directory or "default"
    tasks: str = "sim"              # task family: "sim" (learner.tasks; settings as in
                                    # "sim:seed=3,phrasings=0.6", `parse_task_spec`) or "toy"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)    # see TrainerConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)    # see RolloutConfig
    pipeline: PipelineConfig = field(default_factory=PipelineConfig) # see PipelineConfig
    ray: RayConfig = field(default_factory=RayConfig)                # see RayConfig


def parse_task_spec(name: str, seed: int = 0) -> tuple[str, dict]:
    """("toy", {}) or ("sim", {"seed": N, "phrasings": X}) from a task spec: "toy", or "sim"
    with optional settings after a colon, "sim:seed=3,phrasings=0.6,families=fix_bug+rename_symbol".
    `seed` is the generator seed of the instances (default: the run's `seed`; the recipe's SFT
    data is seed 0, so another seed gives tasks the SFT model never saw), `phrasings` the share
    of them whose instruction is composed from parts (`learner.tasks.generate`: wordings SFT did
    not see), `families` the task families to draw from, joined by "+" (default: all; given, the
    dict has a "families" list), `count` how many instances (default: the pipeline's
    `SIM_TASKS`; a few, drawn again and again, check that training raises their own pass rate).
    ValueError, saying what is accepted, for anything else."""
    family, _, spec = name.partition(":")
    if family == "toy" and not spec:
        return "toy", {}
    if family != "sim":
        raise ValueError(f"unknown task family {name!r}: sim, sim:seed=N,phrasings=SHARE, "
                         "or toy")
    settings: dict = {"seed": seed, "phrasings": 0.0}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, value = item.partition("=")
        if key == "families":
            settings[key] = _families(value, name)
            continue
        try:
            if key == "count":
                settings[key] = int(value)
                if settings[key] < 1:
                    raise ValueError
                continue
            if key not in settings:
                raise ValueError
            settings[key] = int(value) if key == "seed" else float(value)
        except ValueError:
            raise ValueError(f"bad task setting {item!r} in {name!r}: the settings are seed=N, "
                             "phrasings=SHARE, families=A+B and count=N (N >= 1), e.g. "
                             "sim:seed=3,phrasings=0.6,families=fix_bug+rename_symbol") from None
    if not 0.0 <= settings["phrasings"] <= 1.0:
        raise ValueError(f"phrasings must be between 0 and 1 in {name!r}")
    return "sim", settings


def _families(value: str, spec: str) -> list[str]:
    from learner.tasks import FAMILIES
    names = [f.strip() for f in value.split("+") if f.strip()]
    unknown = [f for f in names if f not in FAMILIES]
    if not names or unknown:
        raise ValueError(f"families={value!r} in {spec!r}: give one or more of "
                         f"{'+'.join(FAMILIES)}")
    return names


def to_dict(config: Any) -> dict:
    """A JSON-ready dict of a (nested) config dataclass."""
    return asdict(config)


def from_dict(cls: type, data: dict) -> Any:
    """Rebuild a (nested) config dataclass from `to_dict` output; unknown keys are ignored."""
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
            value = from_dict(f.default_factory, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)
