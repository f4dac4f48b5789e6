"""The training configuration: a tree of small dataclasses, loaded from YAML plus dotted overrides.

``load_config(recipe=..., path=..., overrides=[...])`` starts from a named recipe (or defaults), merges a YAML file,
then applies ``section.key=value`` overrides, and validates everything in one pass: unknown keys (with a did-you-mean),
wrong types, values outside a field's choices and invalid values are all reported together in one
:class:`~mcore_train.errors.ConfigError`. Combinations that depend on the world size (global batch vs micro-batch x
dp, layers vs pipeline stages, heads vs TP, and that the data files exist) are checked by
:meth:`TrainConfig.check_layout` when the run starts, before any process group, or in the same pass when
``load_config`` is given the world size. See
``docs/design/003-config.md`` for why this is a small in-house loader rather than OmegaConf or similar.

The sections are the components' own configs where a component has one (``optimizer`` is
:class:`~mcore_parallel.optim.OptimizerConfig`, ``model`` is :class:`~mcore_models.TransformerConfig`, ``parallel``
is a :class:`~mcore_parallel.ParallelConfig` holding the :class:`~mcore_parallel.ddp.DDPConfig`), and the sections of
:mod:`mcore_train.sections` otherwise.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_models import PRESETS, TransformerConfig, preset
from mcore_models.errors import ConfigError as ModelConfigError
from mcore_models.mamba_config import MambaConfig
from mcore_models.moe_config import MoEConfig
from mcore_parallel.optim import OptimizerConfig
from mcore_train._typed import build, convert, suggest, to_plain
from mcore_train.errors import ConfigError
from mcore_train.multimodal import multimodal_path_problems, multimodal_problems
from mcore_train.sections import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    MultimodalSection,
    ParallelSection,
    SchedulerSection,
    TrainingSection,
)

__all__ = ["TrainConfig", "load_config", "config_changes", "SECTIONS"]


SECTIONS: dict[str, type] = {
    "parallel": ParallelSection,
    "data": DataSection,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerSection,
    "training": TrainingSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "multimodal": MultimodalSection,
}


@dataclass
class TrainConfig:
    """The whole run. ``model`` holds a preset name and/or TransformerConfig fields."""

    model: TransformerConfig
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    multimodal: MultimodalSection = field(default_factory=MultimodalSection)
    recipe: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {name: to_plain(getattr(self, name)) for name in SECTIONS}
        return {"recipe": self.recipe, "model": self.model.to_dict(), **out}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def check_layout(self, world_size: int) -> None:
        """Every problem of this config for ``world_size`` ranks (the layout, the batch, the model, the schedule, the
        data files), in one ConfigError."""
        problems = self.layout_problems(world_size)
        if problems:
            raise ConfigError(problems, header=f"invalid training configuration for {world_size} rank(s)")

    def layout_problems(self, world_size: int) -> list[str]:
        """What :meth:`check_layout` reports, as a list (empty when the run can start)."""
        return [*self._batch_problems(world_size), *self._model_problems(), *self._cp_problems(),
                *self._moe_problems(), *self._run_problems(), *multimodal_problems(self)]  # fmt: skip

    def _batch_problems(self, world_size: int) -> list[str]:
        """The rank layout, and how the global batch splits into micro-batches over it."""
        from mcore_parallel import RankLayout

        par, tr = self.parallel, self.training
        problems = parallel_problems(par, world_size)
        if problems:
            return problems
        dp = RankLayout.build(par, world_size).dp
        per_step = tr.micro_batch_size * dp
        micro = tr.global_batch_size // per_step
        if tr.global_batch_size % per_step:
            problems.append(
                f"training.global_batch_size={tr.global_batch_size} is not divisible by micro_batch_size x dp = "
                f"{tr.micro_batch_size} x {dp} = {per_step}; set it to a multiple of {per_step} (e.g. "
                f"{max(1, round(tr.global_batch_size / per_step)) * per_step}) or change training.micro_batch_size"
            )
        if tr.rampup_batch_size:
            start, inc, _ = tr.rampup_batch_size
            if start % per_step or inc % per_step:
                problems.append(
                    f"training.rampup_batch_size start {start} and increment {inc} must be multiples of "
                    f"micro_batch_size x dp = {tr.micro_batch_size} x {dp} = {per_step}"
                )
        if par.pp > 1 and micro < par.pp:
            problems.append(
                f"pipeline parallelism needs at least pp={par.pp} micro-batches per step, but global_batch_size / "
                f"(micro_batch_size x dp) = {tr.global_batch_size} / {per_step} = {micro}; raise "
                f"training.global_batch_size to at least {par.pp * per_step} or lower training.micro_batch_size"
            )
        if par.pp > 1 and par.vpp_size > 1 and micro % par.pp:
            problems.append(
                f"the interleaved schedule needs the number of micro-batches (global_batch_size / "
                f"(micro_batch_size x dp) = {micro}) to be a multiple of pp={par.pp}"
            )
        return problems

    def _model_problems(self) -> list[str]:
        """The model against the layout: layers over the stages, heads over tp, sequence length."""
        from mcore_models.hybrid import stage_layers

        par, model, seq = self.parallel, self.model, self.data.seq_length
        problems = []
        try:
            for pp_rank in range(par.pp):
                for vpp_rank in range(par.vpp_size):
                    stage_layers(model, par.pp, pp_rank, par.vpp_size, vpp_rank, par.first_stage_layers,
                                 par.last_stage_layers)  # fmt: skip
        except ValueError as e:
            problems.append(f"parallel: {e}")
        problems.extend(f"model: {p}" for p in model.problems(par.tp) if "tensor-parallel" in p)
        if par.sequence_parallel and seq % par.tp:
            problems.append(f"data.seq_length={seq} must be divisible by tp={par.tp} with sequence_parallel")
        if model.position_embedding == "learned_absolute" and seq > model.max_position_embeddings:
            problems.append(
                f"data.seq_length={seq} exceeds model.max_position_embeddings={model.max_position_embeddings} "
                "(learned positions)"
            )
        return problems

    def _cp_problems(self) -> list[str]:
        """Context parallelism against the sequence and the model (``mcore_train.context_parallel``)."""
        cp, tp, seq, model = self.parallel.cp, self.parallel.tp, self.data.seq_length, self.model
        if cp == 1:
            return []
        problems = []
        if seq % (2 * cp):
            problems.append(f"data.seq_length={seq} must be divisible by 2 x parallel.cp = {2 * cp} (each cp rank "
                            "holds two chunks of every sequence)")  # fmt: skip
        elif self.parallel.sequence_parallel and (seq // cp) % tp:
            problems.append(f"data.seq_length / cp = {seq // cp} must be divisible by tp={tp} with sequence_parallel")
        if model.hybrid_pattern is not None:
            problems.append(f"parallel.cp={cp} with a hybrid / Mamba model (model.hybrid_pattern): the SSM scan is "
                            "not context-parallel; set parallel.cp=1")  # fmt: skip
        if model.attention_dropout > 0:
            problems.append(f"parallel.cp={cp}: ring attention has no dropout; set model.attention_dropout=0")
        moe = model.moe
        if moe is not None and moe.aux_loss_coeff > 0 and moe.load_balancing_type in ("aux_loss", "seq_aux_loss"):
            problems.append(f"parallel.cp={cp} with model.moe.load_balancing_type={moe.load_balancing_type}: its "
                            "expert counts would cover each cp rank's chunks only; use global_aux_loss (counts over "
                            "every rank of the stage, exact under cp) or parallel.cp=1")  # fmt: skip
        return problems

    def _moe_problems(self) -> list[str]:
        """Expert parallelism against the model: ``parallel.ep`` and ``parallel.expert_tp`` need MoE layers whose
        experts and widths they divide."""
        par, moe = self.parallel, self.model.moe
        if moe is None:
            if par.ep > 1:
                return [
                    f"parallel.ep={par.ep} splits the experts of MoE layers, but the model is dense (model.moe is "
                    "not set): set parallel.ep=1, or configure model.moe (e.g. model.preset=moe-tiny)"
                ]
            return []
        problems = []
        etp, tp = par.expert_tp_size, par.tp
        if moe.num_experts % par.ep:
            problems.append(
                f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={par.ep}; choose an ep "
                f"that divides {moe.num_experts}"
            )
        if etp not in (1, tp):
            problems.append(
                f"parallel.expert_tp={etp} must be 1 (whole experts per rank) or parallel.tp={tp} (experts split "
                "over the tensor-parallel ranks)"
            )
        elif tp > 1 and etp == 1 and not par.sequence_parallel:
            problems.append(
                f"MoE with parallel.tp={tp} and parallel.expert_tp=1 needs parallel.sequence_parallel=true (each "
                f"tensor-parallel rank routes its share of the sequence); set it, or set parallel.expert_tp={tp}"
            )
        ffn = moe.expert_ffn(self.model.ffn_size)
        if etp > 1 and ffn % etp:
            problems.append(f"the experts' ffn width {ffn} (model.moe.ffn_hidden_size) is not divisible by "
                            f"parallel.expert_tp={etp}")  # fmt: skip
        if moe.pad_expert_input_to_capacity and moe.token_dispatcher != "alltoall":
            problems.append("model.moe.pad_expert_input_to_capacity needs model.moe.token_dispatcher=alltoall")
        return problems

    def _run_problems(self) -> list[str]:
        """The schedule's length, the tokenizer's file, the data."""
        sc, tr, data = self.scheduler, self.training, self.data
        problems = []
        decay = sc.decay_iters if sc.decay_iters is not None else tr.train_iters
        if decay is not None and sc.decay_style != "constant" and sc.warmup_iters > decay:
            problems.append(
                f"scheduler.warmup_iters={sc.warmup_iters} exceeds the decay length {decay} "
                "(scheduler.decay_iters, default training.train_iters)"
            )
        if data.tokenizer != "byte" and not data.tokenizer_model:
            problems.append(f"data.tokenizer={data.tokenizer!r} needs data.tokenizer_model (the model file)")
        if not (data.mock or data.path or data.train_path):
            problems.append("no training data: set data.path (or data.train_path), or data.mock=true")
        if not data.mock:
            problems.extend(multimodal_path_problems(self) if data.multimodal else data_path_problems(data))
        return problems


def parallel_problems(parallel: ParallelSection, world_size: int) -> list[str]:
    """Why the ``parallel`` section cannot split ``world_size`` ranks, each problem naming the section."""
    from mcore_parallel.layout import layout_problems

    return [f"parallel: {p}" for p in layout_problems(parallel, world_size)]


def data_path_problems(data: DataSection) -> list[str]:
    """Every prefix of ``data.path`` / ``data.train_path`` / ... whose ``.idx`` or ``.bin`` file is missing."""
    from mcore_data import parse_blend
    from mcore_data.errors import MCoreDataError

    problems = []
    for key in ("path", "train_path", "valid_path", "test_path"):
        items = getattr(data, key)
        if not items:
            continue
        try:
            blend = parse_blend(items)
        except MCoreDataError as e:
            problems.append(f"data.{key}: {e}")
            continue
        for _, prefix in blend:
            base = prefix[:-4] if prefix.endswith((".idx", ".bin")) else prefix
            idx, bin_ = (Path(f"{base}{ext}").is_file() for ext in (".idx", ".bin"))
            if idx and bin_:
                continue
            if not (idx or bin_):
                what = f"neither {base}.idx nor {base}.bin exists"
            else:
                there, gone = (f"{base}.idx", f"{base}.bin") if idx else (f"{base}.bin", f"{base}.idx")
                what = f"{there} exists but {gone} is missing"
            problems.append(
                f"data.{key}: no dataset at prefix {prefix!r}: {what} (fix the path, or write the pair with "
                "`mcore-data preprocess`)"
            )
    return problems


# ---------------------------------------------------------------------------------------------------- trees
def _changed(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in defaults or v != defaults[k]}


def config_changes(config: TrainConfig) -> dict[str, Any]:
    """What ``config`` sets differently from the defaults, as a plain tree: each section's changed keys, and the
    model as its preset (when it was built from one) plus the fields that differ from that preset.

    A recipe enters :func:`load_config` in this form, so a YAML file and overrides merge into it key by key, and
    ``model.preset=...`` swaps the architecture while keeping the recipe's changes to it (e.g. ``params_dtype``).
    """
    name = config.model.extra.get("preset")
    base = preset(name) if name in PRESETS else TransformerConfig()
    model = _changed(to_plain(config.model), to_plain(base))
    tree: dict[str, Any] = {"model": {"preset": name, **model} if name in PRESETS else model}
    for section, cls in SECTIONS.items():
        changed = _changed(to_plain(getattr(config, section)), to_plain(cls()))
        if changed:
            tree[section] = changed
    return tree


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{dotted}: {k} is not a section"])
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``optimizer.lr=3e-4`` → (``optimizer.lr``, the YAML value of ``3e-4``)."""
    if "=" not in text:
        raise ConfigError([f"override {text!r} must look like section.key=value (e.g. optimizer.lr=3e-4)"])
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.strip(), value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------- loading
def _build_model(data: Mapping[str, Any], errors: list[str]) -> TransformerConfig | None:
    data = dict(data)
    name = data.pop("preset", None)
    hints = typing.get_type_hints(TransformerConfig)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    values: dict[str, Any] = {}
    for k, v in data.items():
        if k not in fields:
            errors.append(f"model.{k}: unknown key{suggest(k, [*fields, 'preset'])}")
            continue
        if k == "rope_scaling" and isinstance(v, Mapping):
            values[k] = dict(v)
            continue
        if k in _SUBCONFIGS and isinstance(v, Mapping):
            values[k] = _build_subconfig(k, v, name, errors)
            continue
        converted = convert(v, hints[k], f"model.{k}", errors)
        if converted is not None or v is None:
            values[k] = converted
    try:
        if name is not None:
            return preset(str(name), **values)
        return TransformerConfig(**values)
    except KeyError as e:
        errors.append(f"model.preset: {e.args[0]}")
    except ModelConfigError as e:
        errors.extend(f"model: {p}" for p in e.problems)
    except TypeError as e:
        errors.append(f"model: {e}")
    return None


_SUBCONFIGS: dict[str, type[Any]] = {"moe": MoEConfig, "mamba": MambaConfig}
"""The model's nested configs that ``model.<key>.<field>`` overrides address field by field."""


def _build_subconfig(key: str, data: Mapping[str, Any], preset_name: Any, errors: list[str]) -> Any:
    """``model.<key>`` (``moe``, ``mamba``) from a mapping: its keys checked and converted, over the preset's
    settings when the model names a preset that has them (so ``model.moe.num_experts=4`` changes only that)."""
    cls = _SUBCONFIGS[key]
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    base = PRESETS.get(str(preset_name), {}).get(key) if preset_name is not None else None
    values: dict[str, Any] = dict(base) if isinstance(base, Mapping) else {}
    ok = True
    for k, v in data.items():
        if k not in fields:
            errors.append(f"model.{key}.{k}: unknown key{suggest(k, fields)}")
            ok = False
            continue
        before = len(errors)
        converted = convert(v, hints[k], f"model.{key}.{k}", errors)
        ok = ok and len(errors) == before
        values[k] = converted
    return cls(**values) if ok else None


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(loaded, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return loaded


def load_config(
    recipe: str | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
    world_size: int | None = None,
) -> TrainConfig:
    """Recipe (or defaults) ← YAML file ← dotted overrides, validated all at once.

    With ``world_size`` (the run's number of processes) the checks of :meth:`TrainConfig.check_layout` join that one
    pass: a layout that does not fit, a missing data file and a misspelt key come back in the same ConfigError.
    """
    from mcore_train.recipes import recipe_tree

    tree: dict[str, Any] = {}
    if recipe is not None:
        tree = recipe_tree(recipe)
    if base is not None:
        tree = _merge(tree, base)
    if path is not None:
        loaded = _read_yaml(path)
        if "recipe" in loaded and recipe is None:
            tree = _merge(recipe_tree(str(loaded["recipe"])), tree)
        tree = _merge(tree, loaded)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return _from_tree(tree, recipe, world_size)


def _from_tree(tree: Mapping[str, Any], recipe: str | None, world_size: int | None = None) -> TrainConfig:
    errors: list[str] = []
    known = [*SECTIONS, "model", "recipe"]
    for key in tree:
        if key not in known:
            errors.append(f"{key}: unknown section{suggest(key, known)}")
    model = _build_model(tree.get("model", {}) or {}, errors)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        raw = tree.get(name, {}) or {}
        if not isinstance(raw, Mapping):
            errors.append(f"{name}: expected a mapping, got {raw!r}")
            continue
        sections[name] = build(cls, raw, name, errors)
    if errors:
        header = "invalid training configuration" + (f" for {world_size} rank(s)" if world_size is not None else "")
        if world_size is not None:  # what can still be checked without the whole config
            if isinstance(sections.get("parallel"), ParallelSection):
                errors.extend(parallel_problems(sections["parallel"], world_size))
            data = sections.get("data")
            if isinstance(data, DataSection) and not data.mock and not data.multimodal:
                errors.extend(data_path_problems(data))
        raise ConfigError(errors, header=header)
    assert model is not None
    config = TrainConfig(model=model, recipe=tree.get("recipe", recipe), **sections)
    if world_size is not None:
        config.check_layout(world_size)
    return config
