"""vLLM's and Ray Serve LLM's configuration shapes, mapped onto specray's (pure dict transforms, no Ray).

A vLLM user writes ``model`` + ``speculative_config`` (``method: ngram | draft_model``) + ``served_model_name`` /
``max_model_len`` / ``max_num_seqs``; a Ray Serve LLM user writes ``llm_configs`` entries with
``model_loading_config``, ``engine_kwargs`` and ``deployment_config``. Both are turned into the dict form of
`specray.config.AppConfig` here, so `AppConfig`, `specray serve` and `specray.serve.llm.build_openai_app` share
one mapping, and anything that does not map fails with an error naming the field.

specray's own extension of vLLM's ``speculative_config``: ``method: cascade`` with ``drafters``, a list of
vLLM-shaped configs (``ngram`` and/or ``draft_model``) ordered smallest first, each drafting for the next one
and the last for the target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: vLLM's defaults for its n-gram proposer: both lookup bounds missing -> 5 and 5; one missing -> the other's
#: value. vLLM drafts from the earliest occurrence of the matched suffix.
VLLM_NGRAM_LOOKUP = 5
VLLM_NGRAM_OCCURRENCE = "earliest"

#: the values of ``speculative_config.method`` specray runs (vLLM's two plus specray's cascade)
SPECULATIVE_METHODS = ("ngram", "draft_model", "cascade")

#: vLLM's dtype names -> specray's (None: the level's default)
_DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
           "float": "float32"}

_NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "prompt_lookup_occurrence"}
_DRAFT_KEYS = {"method", "model", "num_speculative_tokens", "max_model_len", "draft_tensor_parallel_size"}
_CASCADE_KEYS = {"method", "drafters", "num_speculative_tokens"}


class ConfigMappingError(ValueError):
    """A vLLM or Ray Serve LLM setting that specray cannot take (the message names the field)."""


# ------------------------------------------------------------------------------------------------ names


def rename_vllm_names(data: Any, names: Mapping[str, str], where: str) -> Any:
    """Move vLLM's spelling of a field onto specray's (`names`: vLLM name -> specray name); both given is an error."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for alias, field in names.items():
        if alias in out:
            if field in out:
                raise ConfigMappingError(f"{where}: give `{field}` or its vLLM name `{alias}`, not both")
            out[field] = out.pop(alias)
    return out


def served_name(value: Any, where: str = "served_model_name") -> Any:
    """vLLM's ``served_model_name`` is a name or a list of names; specray serves one."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ConfigMappingError(f"{where}: specray serves one model name, got {list(value)!r}")
        return value[0]
    return value


def vllm_dtype(value: Any, where: str = "dtype") -> str | None:
    """vLLM's dtype names (auto, half, float, bfloat16, ...) as a level dtype; None keeps the level's default."""
    key = str(value).lower()
    if key not in _DTYPES:
        raise ConfigMappingError(f"{where}: {value!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def ngram_lookup(lo: int | None, hi: int | None) -> tuple[int, int]:
    """vLLM's rule for the n-gram lookup bounds: both missing -> (5, 5); one missing -> the other's value."""
    if lo is None and hi is None:
        return VLLM_NGRAM_LOOKUP, VLLM_NGRAM_LOOKUP
    return (hi if lo is None else lo), (lo if hi is None else hi)  # type: ignore[return-value]


# -------------------------------------------------------------------------------- speculative_config


def _k(spec: Mapping[str, Any], where: str, default: int | None) -> int:
    k = spec.get("num_speculative_tokens", default)
    if k is None:
        raise ConfigMappingError(f"{where}.num_speculative_tokens is required (as in vLLM)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigMappingError(f"{where}.num_speculative_tokens must be a positive integer, got {k!r}")
    return k


def _method(spec: Mapping[str, Any], where: str) -> str:
    method = spec.get("method")
    if method is None and spec.get("model"):
        method = "draft_model"  # vLLM infers the method from `model`; specray runs a draft model as one
    if method == "[ngram]":  # vLLM's older spelling
        method = "ngram"
    if method not in SPECULATIVE_METHODS:
        raise ConfigMappingError(f"{where}.method must be one of {SPECULATIVE_METHODS}, got {method!r}"
                                 + (" (give `method` or a draft `model`)" if method is None else ""))
    return method


def _unknown(spec: Mapping[str, Any], allowed: set[str], where: str, method: str) -> None:
    extra = sorted(set(spec) - allowed)
    if extra:
        raise ConfigMappingError(f"{where}: {extra} not supported by specray for method {method!r} "
                                 f"(supported: {sorted(allowed)})")


def _drafter(spec: Any, where: str, model_level: Mapping[str, Any], default_k: int | None) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise ConfigMappingError(f"{where} must be a mapping (vLLM's speculative_config), got {type(spec).__name__}")
    method = _method(spec, where)
    if method == "cascade":
        raise ConfigMappingError(f"{where}: a cascade's drafters are ngram or draft_model configs")
    k = _k(spec, where, default_k)
    if method == "ngram":
        _unknown(spec, _NGRAM_KEYS, where, method)
        lo, hi = ngram_lookup(spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max"))
        return {"kind": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
                "prompt_lookup_occurrence": spec.get("prompt_lookup_occurrence", VLLM_NGRAM_OCCURRENCE)}
    _unknown(spec, _DRAFT_KEYS, where, method)
    if not spec.get("model"):
        raise ConfigMappingError(f"{where}: method 'draft_model' needs `model` (a known name, folder or hub id)")
    level = {**model_level, "model": spec["model"], "num_speculative_tokens": k}
    if spec.get("max_model_len") is not None:
        level["max_context"] = spec["max_model_len"]
    tp = spec.get("draft_tensor_parallel_size")
    if tp not in (None, 1):
        if level.get("kind") != "vllm":
            raise ConfigMappingError(f"{where}.draft_tensor_parallel_size: only for vLLM levels")
        level["engine_args"] = {**level.get("engine_args", {}), "tensor_parallel_size": tp}
        level["num_gpus"] = tp
    return level


def levels_from_speculative_config(
    model: str, speculative_config: Mapping[str, Any] | None, model_level: Mapping[str, Any] | None = None,
    where: str = "speculative_config",
) -> list[dict[str, Any]]:
    """The cascade's levels (dicts of `LevelConfig` fields, smallest first) for a target `model` and vLLM's
    ``speculative_config`` (or specray's ``method: cascade``). `model_level`: fields every model level gets
    (kind, dtype, device, max_context, ...); the n-gram level gets none of them."""
    model_level = dict(model_level or {})
    target = {**model_level, "model": model}
    if not speculative_config:
        return [target]
    if not isinstance(speculative_config, Mapping):
        raise ConfigMappingError(f"{where} must be a mapping, got {type(speculative_config).__name__}")
    # the target's engine settings and GPU count (tensor parallel) are its own; a draft model takes one GPU at most
    draft_level = {k: v for k, v in model_level.items() if k != "engine_args"}
    if draft_level.get("num_gpus"):
        draft_level["num_gpus"] = min(float(draft_level["num_gpus"]), 1.0)
    if _method(speculative_config, where) != "cascade":
        drafters = [_drafter(speculative_config, where, draft_level, None)]
    else:
        _unknown(speculative_config, _CASCADE_KEYS, where, "cascade")
        specs = speculative_config.get("drafters")
        if not isinstance(specs, Sequence) or isinstance(specs, str) or not specs:
            raise ConfigMappingError(f"{where}.drafters: a non-empty list of ngram / draft_model configs, "
                                     "smallest first")
        default_k = speculative_config.get("num_speculative_tokens")
        drafters = [_drafter(s, f"{where}.drafters[{i}]", draft_level, default_k) for i, s in enumerate(specs)]
    return [*drafters, target]


# ------------------------------------------------------------------------------- vLLM-shaped AppConfig

#: top-level keys of the vLLM-shaped AppConfig (vLLM's engine-argument names, plus `level_defaults`)
VLLM_APP_KEYS = frozenset({"model", "speculative_config", "served_model_name", "max_model_len", "max_num_seqs",
                           "dtype", "level_defaults"})


def app_dict_from_vllm(data: Mapping[str, Any]) -> dict[str, Any]:
    """An `AppConfig` dict from vLLM's engine-argument names at its top level.

    ``model`` (the target) and ``speculative_config`` make the cascade; ``served_model_name`` (default: ``model``,
    as in vLLM) and ``max_num_seqs`` go to `server`; ``max_model_len`` and ``dtype`` to every model level, with
    ``level_defaults`` (any other `LevelConfig` field: kind, device, num_threads, num_cpus, ...). specray's own
    sections (server, policy, pools, and cascade without ``model``) may sit beside them.
    """
    out = {k: v for k, v in data.items() if k not in VLLM_APP_KEYS}
    server = dict(out.get("server") or {})
    for key, field in (("served_model_name", "model_name"), ("max_num_seqs", "max_batch_size")):
        if key in data:
            if field in server or key in server:
                raise ConfigMappingError(f"{key}: also given as server.{field}; give it once")
            server[field] = served_name(data[key]) if key == "served_model_name" else data[key]
    model = data.get("model")
    if model is None:
        stray = sorted(k for k in ("speculative_config", "max_model_len", "dtype", "level_defaults") if k in data)
        if stray:
            raise ConfigMappingError(f"{stray}: need `model` (the target), or set them per level in `cascade`")
    else:
        if "cascade" in out and "levels" in (out["cascade"] or {}):
            raise ConfigMappingError("give the target as `model` (with speculative_config) or `cascade.levels`, "
                                     "not both")
        level = dict(data.get("level_defaults") or {})
        if "max_model_len" in data:
            level["max_context"] = data["max_model_len"]
        if "dtype" in data and (dt := vllm_dtype(data["dtype"])) is not None:
            level["dtype"] = dt
        cascade = dict(out.get("cascade") or {})
        cascade["levels"] = levels_from_speculative_config(str(model), data.get("speculative_config"), level)
        out["cascade"] = cascade
        server.setdefault("model_name", str(model))
    if server:
        out["server"] = server
    return out


# ------------------------------------------------------------------------------------ Ray Serve LLM

#: LLMConfig fields specray reads; the others must be absent or at Ray Serve LLM's defaults
_LLM_CONFIG_KEYS = {"model_loading_config", "llm_engine", "engine_kwargs", "accelerator_type", "deployment_config",
                    "runtime_env", "placement_group_config", "log_engine_metrics", "experimental_configs"}
_LLM_CONFIG_NEUTRAL: dict[str, tuple[Any, ...]] = {"lora_config": (None,), "server_cls": (None,),
                                                  "accelerator_config": (None,), "callback_config": (None, {})}
#: engine_kwargs that specray maps (the rest go to a vLLM level's engine_args)
_ENGINE_MAPPED = ("max_model_len", "max_num_seqs", "dtype", "speculative_config", "served_model_name")
#: experimental_configs.specray: what it may hold
_EXTENSION_KEYS = {"kind", "level_defaults", "server", "policy", "placement", "transport", "nested", "relay",
                   "start_timeout_s"}


def _load_entry(entry: Any, where: str) -> Mapping[str, Any]:
    if isinstance(entry, str):  # Ray Serve LLM takes a path to a YAML file defining one LLMConfig
        import yaml

        path = Path(entry)
        if not path.is_file():
            raise ConfigMappingError(f"{where}: could not load model config from {entry} (no such file)")
        entry = yaml.safe_load(path.read_text())
    if hasattr(entry, "model_dump"):  # a ray.serve.llm.LLMConfig object
        entry = entry.model_dump(exclude_unset=True)
    if not isinstance(entry, Mapping):
        raise ConfigMappingError(f"{where} must be a mapping (Ray Serve LLM's LLMConfig)")
    return entry


def _gpus_requested(cfg: Mapping[str, Any]) -> bool:
    opts = (cfg.get("deployment_config") or {}).get("ray_actor_options") or {}
    return bool(cfg.get("accelerator_type")) or float(opts.get("num_gpus", 0) or 0) > 0


def app_from_llm_config(entry: Any, where: str = "llm_configs[0]") -> tuple[dict[str, Any], dict[str, Any]]:
    """One Ray Serve LLM ``LLMConfig`` (dict, YAML path or object) -> (AppConfig dict, Serve deployment options).

    model_loading_config.model_id is the served name and model_source (default model_id) the target;
    engine_kwargs' max_model_len / max_num_seqs / dtype / speculative_config map as in vLLM, other engine_kwargs
    go to a vLLM target's engine; deployment_config becomes the Coordinator deployment's options. Levels run
    vLLM on GPUs when the config asks for an accelerator (accelerator_type or GPUs in ray_actor_options), else
    transformers on CPU; ``experimental_configs: {specray: {kind: hf | vllm, ...}}`` says so explicitly and may
    carry specray's own settings (level_defaults, server, policy, placement, ...).
    """
    cfg = _load_entry(entry, where)
    for key in sorted(set(cfg) - _LLM_CONFIG_KEYS):
        if key not in _LLM_CONFIG_NEUTRAL:
            raise ConfigMappingError(f"{where}.{key}: not a field specray reads from an LLMConfig")
        if cfg[key] not in _LLM_CONFIG_NEUTRAL[key]:
            raise ConfigMappingError(f"{where}.{key}: not supported by specray")
    engine_name = str(cfg.get("llm_engine", "vLLM"))
    if engine_name.lower() != "vllm":
        raise ConfigMappingError(f"{where}.llm_engine: {engine_name!r}; specray runs vLLM or transformers levels")
    mlc = cfg.get("model_loading_config")
    if not isinstance(mlc, Mapping) or not mlc.get("model_id"):
        raise ConfigMappingError(f"{where}.model_loading_config.model_id is required")
    bad = sorted(set(mlc) - {"model_id", "model_source", "tokenizer_source"})
    if bad:
        raise ConfigMappingError(f"{where}.model_loading_config: {bad} not supported by specray")
    source = mlc.get("model_source") or mlc["model_id"]
    if not isinstance(source, str):
        raise ConfigMappingError(f"{where}.model_loading_config.model_source: cloud mirrors are not supported by "
                                 "specray; give a known name, local folder or hub id")
    if mlc.get("tokenizer_source") not in (None, source):
        raise ConfigMappingError(f"{where}.model_loading_config.tokenizer_source: specray loads the tokenizer "
                                 "from the model's own folder")
    ext = dict((cfg.get("experimental_configs") or {}).get("specray") or {})
    bad = sorted(set(ext) - _EXTENSION_KEYS)
    if bad:
        raise ConfigMappingError(f"{where}.experimental_configs.specray: {bad} unknown "
                                 f"(known: {sorted(_EXTENSION_KEYS)})")
    kind = ext.pop("kind", None) or ("vllm" if _gpus_requested(cfg) else "hf")
    level: dict[str, Any] = {"kind": kind, **(ext.pop("level_defaults", None) or {})}
    if cfg.get("accelerator_type"):
        level.setdefault("accelerator_type", cfg["accelerator_type"])
    engine = dict(cfg.get("engine_kwargs") or {})
    for key in _ENGINE_MAPPED:
        engine.pop(key, None)
    if kind == "vllm":
        level.setdefault("device", "cuda" if _gpus_requested(cfg) else "cpu")
        if engine:
            level["engine_args"] = engine
        if level["device"] != "cpu":
            world = int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))
            level.setdefault("num_gpus", world)
    elif engine:
        raise ConfigMappingError(f"{where}.engine_kwargs: {sorted(engine)} are vLLM engine settings, but these "
                                 "levels run transformers (no accelerator asked for); set accelerator_type or "
                                 "experimental_configs.specray.kind: vllm, or drop them")
    ek = cfg.get("engine_kwargs") or {}
    if ek.get("served_model_name") not in (None, mlc["model_id"], [mlc["model_id"]]):
        raise ConfigMappingError(f"{where}.engine_kwargs.served_model_name: the served name is "
                                 "model_loading_config.model_id")
    flat: dict[str, Any] = {"model": source, "served_model_name": mlc["model_id"], "level_defaults": level}
    for key in ("max_model_len", "max_num_seqs", "dtype", "speculative_config"):
        if ek.get(key) is not None:
            flat[key] = ek[key]
    if ext.get("server"):
        flat["server"] = ext.pop("server")
    if ext.get("policy"):
        flat["policy"] = ext.pop("policy")
    cascade = {k: ext.pop(k) for k in ("placement", "transport", "nested", "relay", "start_timeout_s") if k in ext}
    pg = cfg.get("placement_group_config")
    if pg:
        if set(pg) - {"strategy"}:
            raise ConfigMappingError(f"{where}.placement_group_config: specray reserves one bundle per level "
                                     "itself; only `strategy` is taken")
        cascade.setdefault("placement", {})["strategy"] = pg["strategy"]
    if cascade:
        flat["cascade"] = cascade
    app = app_dict_from_vllm(flat)
    deployment = dict(cfg.get("deployment_config") or {})
    if cfg.get("runtime_env"):
        opts = dict(deployment.get("ray_actor_options") or {})
        opts.setdefault("runtime_env", cfg["runtime_env"])
        deployment["ray_actor_options"] = opts
    return app, deployment


def app_from_llm_serving_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ray Serve LLM's ``LLMServingArgs`` (``{llm_configs: [...]}``) -> (AppConfig dict, deployment options).

    specray serves one model (the target, with its drafters) per application: give each model its own one."""
    bad = sorted(k for k, v in args.items() if k != "llm_configs" and v not in (None, {}))
    if bad:
        raise ConfigMappingError(f"{bad}: specray's HTTP ingress is the model's own deployment; "
                                 "give only llm_configs")
    configs = args.get("llm_configs")
    if not isinstance(configs, Sequence) or isinstance(configs, str) or len(configs) != 1:
        n = len(configs) if isinstance(configs, Sequence) and not isinstance(configs, str) else configs
        raise ConfigMappingError(f"llm_configs: specray serves one model per application (one entry), got {n!r}; "
                                 "give each model its own application")
    return app_from_llm_config(configs[0])
