"""The DeepSpeed training engine (``trainer.backend: deepspeed``): ZeRO stages 0-3, data parallel.

    cfg = build_config(..., trainer.backend=deepspeed, trainer.zero_stage=2)
    state = init_state(cfg)                    # ENGINES["deepspeed"] -> deepspeed_engines(models, cfg)
    stats = update(state, batch, cfg)          # same call as with the torch backend

Several processes (data parallel, one replica of the models each)::

    ragen train EXP --set trainer.backend=deepspeed --nproc 2          # a whole run (flows/ranks.py)
    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 my_script.py

Each process builds the same state and calls ``update`` on the same full batch (in a run, the session
gathers every rank's rollouts first: ragen_core/session.py);
``update`` gives every rank its share of each mini-batch's rows (see
:func:`ragen_core.trainer.update.rank_micro_rows`) and DeepSpeed averages the
gradients. On a machine without CUDA, DeepSpeed runs on its CPU accelerator
(``DS_ACCELERATOR=cpu``, set here when the models are on the CPU) over gloo.

How this engine keeps the torch backend's math (``TorchEngine``):

- The optimizer is the same ``torch.optim.AdamW`` over the same parameter
  groups, handed to ``deepspeed.initialize`` as a client optimizer. ZeRO 1/2
  runs it on flat fp32 partitions; AdamW is elementwise, so the update is the
  same. The weights DeepSpeed holds are fp32; ``trainer.precision: bf16`` runs the forwards under bf16
  autocast (as DeepSpeed's own ``torch_autocast`` mode does, and verl's FSDP mixed precision), so no fp16/bf16
  section is in the config. DeepSpeed's ``bf16`` mode keeps bf16 weights in the module and the fp32 masters
  inside the ZeRO optimizer: the weights the next forward and the rollouts use then move only when a master
  crosses a bf16 step. Measured on the tiny model at lr 1e-6 (ZeRO 2): one step moved them by a summed |dw| of
  0.0037, against 0.129 in fp32 and in autocast, the rounding of an AdamW step on bf16 weights.
- Gradient accumulation belongs to our update loop, which already divides every
  micro-batch loss by the whole mini-batch's count. So the DeepSpeed config has
  ``gradient_accumulation_steps: 1`` (``backward`` divides the loss by it, and
  we also pass ``scale_wrt_gas=False``) and ``managed_gradient_accumulation:
  false``: ``backward`` only accumulates, ``step()`` is the accumulation
  boundary, whatever the number of micro-batches.
- DeepSpeed *averages* gradients over the W ranks, but each rank's loss is
  already its share of the whole mini-batch's loss (sum over ranks = the
  1-process loss), so ``backward`` multiplies the loss by W.
- Clipping to ``grad_clip`` and the returned pre-clip global norm: at stage 0
  a step pre-hook on the AdamW clips the (already all-reduced) gradients with
  ``clip_grad_norm_`` exactly like TorchEngine; at stages 1/2 the ZeRO optimizer
  clips (``gradient_clipping``) and reports the norm of the whole gradient.
  A non-finite norm skips the step in both cases (``skipped`` counts them).

- Forwards go through DeepSpeed's engine: the modules sit in a container whose
  ``forward(fn, *args)`` just calls ``fn``, and :meth:`DeepSpeedEngine.forward`
  calls the DeepSpeed engine with it. ZeRO-3 counts micro-steps in that forward
  and adds a backward's gradients to the step's only after the first (without
  it, every backward would replace the previous ones), and it gathers each
  layer's weights around that layer's use and frees them after.
- ZeRO-3 partitions every weight, so code that reads or writes weights outside
  a forward (checkpoints, ``save_pretrained``, a vLLM sync) does it inside
  :meth:`DeepSpeedEngine.full_weights` (``deepspeed.zero.GatheredParameters``).
  Rollouts, evaluation and the collapse diagnostics call the actor directly,
  inside :meth:`DeepSpeedEngine.generation_weights`: ZeRO-3 gathers every
  weight once and its per-layer hooks are off, instead of gathering and
  releasing each layer at every token (DeepSpeed's
  ``unwrap_model_for_generation``, as TRL samples under ZeRO-3).

State dicts have TorchEngine's layout (torch AdamW ``state_dict()`` of the
unflattened parameters, in parameter-group order) at every stage, so
checkpoints move between backends and world sizes. Under ZeRO 1-3 with W > 1,
``state_dict`` and ``full_weights`` gather the partitions: every rank must call them.

Run the tests with ``python -m pytest tests/unit/trainer/test_deepspeed_engine.py -q``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ragen_core import distributed
from ragen_core.config import ConfigError, ExperimentConfig
from ragen_core.torch_builds import exclusive_build
from ragen_core.trainer.engine import Precision, adamw, bump_versions, learning_rates, trainable_parameters
from ragen_core.trainer.models import PolicyModels

__all__ = ["DeepSpeedEngine", "deepspeed_engines", "init_distributed"]

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")
T = TypeVar("T")


class _Modules(nn.ModuleDict):
    """The trained modules by name, as one module for ``deepspeed.initialize``; its forward runs a given function,
    so any forward of the modules (policy loss, values, a reference pass) can go through DeepSpeed's engine."""

    def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)


def init_distributed(device: torch.device) -> None:
    """Make DeepSpeed usable in this process for modules on ``device``.

    Picks DeepSpeed's CPU accelerator for CPU modules (it must be chosen before
    deepspeed first looks for one), then starts the torch process group if no one
    has: from torchrun's environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``…) when
    present (:func:`ragen_core.distributed.join`), else a one-process group on an
    in-memory store (no port opened) and ``LOCAL_RANK=0``, which DeepSpeed requires.
    Raises ConfigError when deepspeed is missing or already runs on another device type.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        raise ConfigError(f"trainer.backend: deepspeed is not importable ({e}); install the [gpu] extra "
                          "or use trainer.backend=torch") from None
    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise ConfigError(f"trainer.backend: deepspeed runs on {accelerator!r} in this process but the models are on "
                          f"{device.type!r}; set model.device to match (or DS_ACCELERATOR before starting)")
    if not torch.distributed.is_initialized():
        if distributed.launched():  # torchrun (or `ragen train --nproc`) named this rank and its world
            distributed.join(device)
        else:
            backend = "gloo" if device.type == "cpu" else "nccl"
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
            os.environ.setdefault("LOCAL_RANK", "0")  # deepspeed.initialize insists on it (launchers set it)
    _forget_stale_world_clone()
    _load_shm_op()
    deepspeed.init_distributed(verbose=False)  # wraps the existing group


SHM_OP_LOCK_TIMEOUT_S = 600.0
"""How long a process waits for another one's build of DeepSpeed's shared-memory op (a first build takes about
30 s on 2 cores) before it gives up with an error."""


def _load_shm_op() -> None:
    """Load DeepSpeed's CPU shared-memory collective op (``deepspeed_shm_comm``) before ``deepspeed.init_distributed``
    does: DeepSpeed builds it with torch's extension builder at every start (ninja skips an up-to-date build), and a
    process killed during that would leave the other starts on the machine waiting forever; built here under a lock that
    dies with its holder (ragen_core/torch_builds.py), DeepSpeed then finds it loaded (``OpBuilder._loaded_ops``).
    Does nothing where DeepSpeed has no such op for the accelerator."""
    import deepspeed.ops  # lazily: deepspeed is the optional [gpu] extra and slow to import
    from deepspeed.accelerator import get_accelerator
    from filelock import Timeout
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    directory = Path(_get_build_directory(builder.name, verbose=False))
    try:
        with exclusive_build(directory, SHM_OP_LOCK_TIMEOUT_S):
            builder.load(verbose=False)
    except Timeout:
        raise RuntimeError(f"DeepSpeed's {builder.name} op: another process held its build folder {directory} for "
                           f"{SHM_OP_LOCK_TIMEOUT_S:.0f} s (its lock: {directory / 'ragen.lock'})") from None


_cloned_from: list[object] = []
"""The default process group DeepSpeed's cached world clone was made from (see below)."""


def _forget_stale_world_clone() -> None:
    """DeepSpeed clones the world group once per process (``deepspeed.utils.groups._WORLD_GROUP``) and uses the
    clone as every engine's data-parallel group. When a process runs one world after another (a one-process run,
    then rank 0 of ``ragen train --nproc 2``: the group is destroyed and a new one made), the clone would still be
    the old, destroyed group: drop it so the next engine clones the current one."""
    from deepspeed.utils import groups  # lazily: deepspeed is the optional [gpu] extra and slow to import

    world = torch.distributed.group.WORLD
    if _cloned_from and _cloned_from[0] is not world:
        groups._WORLD_GROUP = None
    _cloned_from[:] = [world]


def _align_zero3_numbers() -> None:
    """Give this engine's modules and parameters the same ZeRO-3 numbers on every rank.

    ZeRO-3 numbers modules and parameters (``ds_id``) with process-wide counters and, when it records a
    forward's trace, checks that the ranks' numbers agree. A rank 0 that built ZeRO-3 engines before (an
    earlier run in the same process: tests, a long-lived worker) counts on from there while freshly started
    ranks count from 0, and the first update fails with "Detected a disagreement on list contents". Every rank
    continues from the highest count instead (a collective; the numbers stay unique within each process).
    """
    if distributed.world_size() == 1:
        return
    # lazily: deepspeed is the optional [gpu] extra and slow to import
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    module_count = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]  # its `count=[0]` default
    counts = distributed.all_gather((module_count[0], Init.param_id))
    module_count[0] = max(m for m, _ in counts)
    Init.param_id = max(p for _, p in counts)


class DeepSpeedEngine:
    """Backward and optimizer step of one set of modules through ``deepspeed.initialize``.

    modules: the trained modules by name (wrapped in one container so that
    DeepSpeed sees every parameter; :meth:`forward` runs a function through it);
    param_groups: AdamW groups over their trainable parameters (lr per group);
    extra_config: more DeepSpeed config (``trainer.deepspeed``), under the keys set here.
    """

    def __init__(self, modules: dict[str, nn.Module], param_groups: list[dict[str, Any]],
                 betas: tuple[float, float], weight_decay: float, grad_clip: float, zero_stage: int,
                 micro_batch_size: int, extra_config: dict[str, Any] | None = None,
                 precision: Precision | None = None) -> None:
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        import deepspeed

        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"trainer.zero_stage: {zero_stage} is not a ZeRO stage (use 0, 1, 2 or 3)")
        self.params = [p for g in param_groups for p in g["params"]]
        self._group_sizes = [len(g["params"]) for g in param_groups]
        self.optimizer = adamw(param_groups, betas, weight_decay)
        self.zero_stage = zero_stage
        self.grad_clip = grad_clip
        self.skipped = 0
        self.precision = precision or Precision()
        self._norm = float("nan")
        if zero_stage == 0:  # DeepSpeed leaves fp32 clipping at stage 0 to us: clip right before AdamW steps
            self.optimizer.register_step_pre_hook(self._clip_or_drop)
        extra = dict(extra_config or {})  # trainer.deepspeed; the config refuses the keys set below
        config = {
            **extra,
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": 1,  # our update accumulates and normalises; see the module docstring
            "managed_gradient_accumulation": False,  # step() is the boundary, whatever the micro-batch count
            "gradient_clipping": grad_clip if zero_stage > 0 else 0.0,
            # memory_efficient_linear off: under ZeRO-3 DeepSpeed otherwise replaces torch.nn.functional.linear
            # for the whole process, for good ("This will persist unless manually reset"). A later run in the
            # same process (a test suite, a sweep worker) then computes differently: measured 7.5e-5 on the
            # 1- vs 2-process weights of tests/flows/test_train_ranks.py after a ZeRO-3 test had run.
            "zero_optimization": {"memory_efficient_linear": False, **extra.get("zero_optimization", {}),
                                  "stage": zero_stage},
            # ZeRO-Offload (offload_optimizer) steps the client optimizer on the host copies of the fp32 partitions:
            # torch's fused AdamW does (the same math as every other stage); DeepSpeed refuses any optimizer but its
            # own CPUAdam there unless told otherwise
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": extra.get("steps_per_print", 2**62),
            "wall_clock_breakdown": extra.get("wall_clock_breakdown", False),
        }
        if zero_stage == 3:
            _align_zero3_numbers()
        self.engine, self.zero_optimizer, _, _ = deepspeed.initialize(
            model=_Modules(modules), optimizer=self.optimizer, config=config)
        self.world_size = int(torch.distributed.get_world_size())
        self.rank = int(torch.distributed.get_rank())

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this process's rank, number of data-parallel processes)."""
        return self.rank, self.world_size

    def _clip_or_drop(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Stage 0: clip like TorchEngine; a non-finite norm drops the gradients so AdamW leaves everything alone."""
        self._norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        if not math.isfinite(self._norm):
            for p in self.params:  # AdamW skips parameters without a gradient: no update, no state change
                p.grad = None

    def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` run inside DeepSpeed's forward (see the module docstring), under the
        precision's autocast."""
        with self.precision.autocast():
            return self.engine(fn, *args, **kwargs)

    def full_weights(self, modify: bool = False) -> contextlib.AbstractContextManager[None]:
        """Under ZeRO-3, every parameter gathered whole for the block (a collective: every rank enters it);
        ``modify``: rank 0's writes are kept (partitioned again on exit, and ZeRO's fp32 copy refreshed by
        :meth:`load_state_dict`). Other stages keep whole parameters: nothing to do."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        from deepspeed.runtime.zero import GatheredParameters

        return GatheredParameters(list(self.engine.module.parameters()), modifier_rank=0 if modify else None)

    def generation_weights(self) -> contextlib.AbstractContextManager[None]:
        """Under ZeRO-3, every parameter gathered whole once for the block (a collective: every rank enters it)
        and the per-layer gathering hooks off, so that the actor's own forwards run as on one process: no gather
        and release of every layer at every generated token, and no collective, so the ranks may run different
        forwards. Peak memory is the whole model's, as :meth:`full_weights`'s. Other stages: nothing to do."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        return self._gathered_without_hooks()

    @contextlib.contextmanager
    def _gathered_without_hooks(self) -> Iterator[None]:
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        try:
            with unwrap_model_for_generation(self.engine):
                yield
        finally:
            optimizer = self.engine.optimizer
            offload = getattr(optimizer, "parameter_offload", optimizer)
            if not offload.forward_hooks:  # the block raised: DeepSpeed's context puts its hooks back only on success
                offload._register_deepspeed_module(offload.module)
            # ZeRO-3's record of the order in which the last training forward fetched the layers is stale once the
            # hooks are registered again, and DeepSpeed releases without PR 8043 (0.19.0 has not got it, 0.19.8
            # has) keep it: the next training forward follows it and fails (IndexError in record_parameters).
            # Cleared, that forward records a fresh one.
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()

    def backward(self, loss: torch.Tensor) -> None:
        # × W: DeepSpeed averages the ranks' gradients, but each rank's loss is already its share of the sum.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        if self.zero_stage < 3:  # ZeRO-3's parameters are partitions, read only through its own gathering hooks
            bump_versions(self.params)
        norm = self._norm if self.zero_stage == 0 else float(self.engine.get_global_grad_norm())
        if not math.isfinite(norm):
            self.skipped += 1
        return norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": torch AdamW state_dict of the unflattened parameters, "skipped": n}`` (TorchEngine's
        layout)."""
        if self.zero_stage == 0:
            return {"optimizer": self.optimizer.state_dict(), "skipped": self.skipped}
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_get_full_optimizer_state

        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        index = 0
        zero = self.zero_optimizer
        for g, (group, flat_group) in enumerate(zip(self._param_groups(), self.optimizer.param_groups, strict=True)):
            flat_state = self.optimizer.state.get(self._flats(g)[0], {})
            if flat_state and self.zero_stage < 3:  # ZeRO 1/2 link the fragments once, after group 0's first step
                lazy_init_hp_params_optimizer_state(zero.bit16_groups[g], zero.single_partition_of_fp32_groups[g],
                                                    self.optimizer.state)
            ids = list(range(index, index + len(group)))
            index += len(group)
            for i, p in zip(ids, group, strict=True):
                if flat_state:  # collective under W > 1: every rank contributes its partition
                    state[i] = {"step": flat_state["step"].clone(),
                                **{k: safe_get_full_optimizer_state(p, k).detach().cpu() for k in _ADAM_KEYS}}
            groups.append({**{k: v for k, v in flat_group.items() if k != "params"}, "params": ids})
        return {"optimizer": {"state": state, "param_groups": groups}, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (from either backend). Also re-reads the modules' weights into ZeRO's
        fp32 master copy: load the weights first (``load_checkpoint`` does), then this."""
        self.skipped = int(state.get("skipped", 0))
        if self.zero_stage == 0:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        # lazily: deepspeed is the optional [gpu] extra and slow to import
        from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_set_full_optimizer_state

        saved = state["optimizer"]
        groups = self._param_groups()
        if len(saved["param_groups"]) != len(groups):
            raise ValueError(f"optimizer state has {len(saved['param_groups'])} parameter groups, "
                             f"this engine {len(groups)}")
        zero = self.zero_optimizer
        for g, (group, flat_group, saved_group) in enumerate(
                zip(groups, self.optimizer.param_groups, saved["param_groups"], strict=True)):
            flat_group.update({k: v for k, v in saved_group.items() if k != "params"})
            per_param = [saved["state"].get(i) for i in saved_group["params"]]
            if all(s is None for s in per_param):
                continue
            step = next(s["step"] for s in per_param if s is not None)
            flats = self._flats(g)
            for flat in flats:
                self.optimizer.state[flat] = {"step": step.clone().to(torch.float32),
                                              **{k: torch.zeros_like(flat) for k in _ADAM_KEYS}}
            if self.zero_stage < 3:  # point every parameter's fragment at the new state tensors
                lazy_init_hp_params_optimizer_state(zero.bit16_groups[g], zero.single_partition_of_fp32_groups[g],
                                                    self.optimizer.state)
            # then fill them parameter by parameter (ZeRO-3 finds each parameter's slice itself)
            padded = self.zero_stage == 3 and self.world_size > 1
            for p, s in zip(group, per_param, strict=True):
                if s is not None:
                    for k in _ADAM_KEYS:
                        value = s[k].to(flats[0].device, flats[0].dtype)
                        if padded:
                            self._set_zero3_state(p, value, k)
                        else:
                            safe_set_full_optimizer_state(p, value, k)
        zero.refresh_fp32_params()  # ZeRO steps its own fp32 copy of the weights: take the loaded ones

    def _set_zero3_state(self, param: nn.Parameter, value: torch.Tensor, key: str) -> None:
        """ZeRO-3 with W > 1: this rank's slice of one parameter's whole optimizer state ``value``.

        DeepSpeed's ``set_full_hp_param`` cuts rank r's slice ``[r·n, (r+1)·n)`` of the whole tensor without the
        padding ZeRO-3 adds when a parameter's size is not a multiple of W, and fails on the last rank (a
        one-element bias, or most odd sizes; a checkpoint saved by fewer processes then cannot be resumed). The
        slice here is cut to what exists and the padding left at zero.
        """
        zero = self.zero_optimizer
        part, group = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
        n = part.numel()
        start = n * zero._get_param_partition_rank(param)
        piece = value.flatten()[start:start + n]
        part.data.zero_()
        part.data[: piece.numel()].copy_(piece)
        if zero._swappable_optimizer_subgroup(group):  # NVMe offload: write the state back out, as DeepSpeed does
            zero._optimizer_states_and_gradient_swap_out(group)

    def _flats(self, group: int) -> list[torch.Tensor]:
        """ZeRO's flat fp32 partitions that AdamW steps for one parameter group (ZeRO 1/2: one; ZeRO-3: one per
        sub-group, listed in the optimizer's groups only during its step)."""
        zero = self.zero_optimizer
        if self.zero_stage < 3:
            return [zero.single_partition_of_fp32_groups[group]]
        return [flat for i, flat in enumerate(zero.fp32_partitioned_groups_flat)
                if zero.sub_group_to_group_id[i] == group]

    def _param_groups(self) -> list[list[nn.Parameter]]:
        """Our parameters per AdamW group, in the order they were given (ZeRO replaced the optimizer's lists)."""
        out, start = [], 0
        for n in self._group_sizes:
            out.append(self.params[start:start + n])
            start += n
        return out


def deepspeed_engines(models: PolicyModels, cfg: ExperimentConfig) -> tuple[DeepSpeedEngine, DeepSpeedEngine | None]:
    """(actor engine, critic engine or None) for ``trainer.backend: deepspeed``; the value head shares the actor's.

    Raises ConfigError for a stage other than 0-3 or when deepspeed cannot be used.
    """
    t = cfg.trainer
    init_distributed(models.device)
    actor_lr, critic_lr = learning_rates(cfg)
    modules: dict[str, nn.Module] = {"actor": models.actor}
    groups = [{"params": trainable_parameters(models.actor), "lr": actor_lr}]
    if models.value_head is not None:  # one backward trains both, so one engine steps both (as with torch)
        modules["value_head"] = models.value_head
        groups.append({"params": trainable_parameters(models.value_head), "lr": critic_lr})
    # The settings both engines share; a partial (not a dict of kwargs) keeps each one's type checked.
    engine = functools.partial(DeepSpeedEngine, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                               zero_stage=t.zero_stage, micro_batch_size=t.micro_batch_size, extra_config=t.deepspeed,
                               precision=Precision.of(cfg))
    actor = engine(modules, groups)
    critic = None
    if models.critic is not None:
        critic = engine({"critic": models.critic}, [{"params": trainable_parameters(models.critic), "lr": critic_lr}])
    return actor, critic
