"""`specray serve MODEL`: the app on Ray Serve from vLLM-like flags, in one line.

    specray serve qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --ngram
    specray serve qwen-1.5b --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    specray serve --config serve_config.yaml --port 8001

The flags build an `AppConfig` (`config_from_args`, pure: the unit tests check it) over an optional `--config`
file (specray's AppConfig YAML, vLLM's flat shape, Ray Serve LLM's llm_configs, or a whole Serve config file);
`run_serve` pulls the known models it will load (with progress bars), starts Ray and Serve, shows a progress bar
while the levels load, prints where it listens and blocks until Ctrl-C (or SIGTERM), then shuts down what it
started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from specray.compat import ConfigMappingError, app_dict_from_vllm, vllm_dtype
from specray.config import AppConfig, LevelConfig, ServerConfig
from specray.spec.params import VerifyMethod

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_K = 4


def _level_default(name: str) -> Any:
    return LevelConfig.model_fields[name].default


def _server_default(name: str) -> Any:
    return ServerConfig.model_fields[name].default


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `specray serve` (options left unset fall back to the --config file, then to the default
    shown)."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="target model: known name (see `specray models list`), folder or hub id; optional with "
                   "--config (then it replaces the config's levels) (default: none)")
    g = p.add_argument_group("speculation (vLLM: --speculative-config)")
    g.add_argument("--draft", action="append", default=[], metavar="M",
                   help="draft model, smallest first; repeat for a cascade (each drafts for the next, the last for "
                   "MODEL) (default: none)")
    g.add_argument("--ngram", action="store_true",
                   help="add an n-gram (prompt lookup) drafter below the draft models, with vLLM's defaults "
                   "(default: off)")
    g.add_argument("--num-speculative-tokens", "--k", dest="k", type=int, action="append", default=None,
                   metavar="K", help=f"tokens each drafter proposes per round: once for all or once per drafter "
                   f"(n-gram first) (default: {DEFAULT_K}; the planner adapts K to live acceptance)")
    g.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="n-gram: shortest suffix to look up (default: as vLLM: --prompt-lookup-max, else 5)")
    g.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="n-gram: longest suffix to look up (default: as vLLM: --prompt-lookup-min, else 5)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config as JSON: {\"method\": \"ngram\" | \"draft_model\", "
                   "\"num_speculative_tokens\": K, ...}, or specray's {\"method\": \"cascade\", \"drafters\": "
                   "[<ngram config>, <draft_model config>, ...]} (smallest first); instead of --draft / --ngram "
                   "(default: none)")
    g.add_argument("--verify-method", choices=[m.value for m in VerifyMethod], default=None,
                   help="how each level verifies drafts at temperature > 0; temperature 0 is always greedy "
                   f"(default: {_level_default('verify_method').value})")
    g.add_argument("--draft-confidence", type=float, default=None,
                   help="draft models end a draft after a token they gave a probability below this; 0: off "
                   f"(default: {_level_default('draft_confidence')})")
    g = p.add_argument_group("model and engine (vLLM's names)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model id on /v1/models and in requests (default: MODEL, as vLLM; without MODEL: the "
                   "--config file's)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length of every model level (default: the model's own)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences in the running batch at most (default: {_server_default('max_batch_size')})")
    g.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "half", "float32", "float"],
                   help=f"weights' dtype; auto: {_level_default('dtype')} (default: auto)")
    g.add_argument("--kind", default=None, choices=["hf", "vllm", "auto"],
                   help="engine of the model levels: transformers, vLLM, or auto (vLLM where it is installed) "
                   f"(default: {_level_default('kind')})")
    g.add_argument("--device", default=None,
                   help=f"torch device of the model levels, e.g. cuda (default: {_level_default('device')})")
    g.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs each model level reserves (default: 0 on CPU; on a GPU device 1/number of model "
                   "levels, so all levels share one GPU)")
    g.add_argument("--num-cpus", type=float, default=None,
                   help=f"CPUs each model level reserves (default: {_level_default('num_cpus')})")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of each model level (default: torch's own)")
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML: an AppConfig (specray's or vLLM's flat names), Ray Serve LLM's {llm_configs: [...]}, "
                   "or a Serve config file (its first application); flags given here override it (default: none)")
    g.add_argument("--host", default=None,
                   help=f"HTTP host; 0.0.0.0 listens on every interface (default: {DEFAULT_HOST}, or the Serve "
                   "config file's)")
    g.add_argument("--port", type=int, default=None,
                   help=f"HTTP port (default: {DEFAULT_PORT}, or the Serve config file's)")
    g.add_argument("--api-key", default=None,
                   help="requests need 'Authorization: Bearer KEY' (default: $SPECRAY_API_KEY, else none)")
    g.add_argument("--in-process", action="store_const", const=True, default=None,
                   help="run the model levels inside the coordinator's process instead of one Ray actor each "
                   "(default: off)")
    g.add_argument("--address", default="local",
                   help="Ray cluster: local starts a fresh one owned by this command; auto or host:port joins a "
                   "running cluster (default: local)")
    g.add_argument("--app-name", default="specray", help="Serve application name (default: specray)")
    g.add_argument("--route-prefix", default="/", help="Serve route prefix (default: /)")
    g.add_argument("--no-pull", action="store_true",
                   help="do not pull known models here before starting (the level actors pull what they miss)")


# ------------------------------------------------------------------------------------------ flags -> config


def _read_config(path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(application args, Coordinator deployment options, http_options) from a --config file of any shape."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, Mapping):
        raise ConfigMappingError(f"{path}: expected a mapping at the top")
    if "applications" not in data:
        return dict(data), {}, {}
    apps = data["applications"] or []
    if len(apps) != 1:
        raise ConfigMappingError(f"{path}: `specray serve` runs one application, the file has {len(apps)}")
    app = apps[0]
    options: dict[str, Any] = {}
    for dep in app.get("deployments") or []:
        if dep.get("name") == "Coordinator":
            options = {k: v for k, v in dep.items() if k != "name"}
    return dict(app.get("args") or {}), options, dict(data.get("http_options") or {})


def speculative_config_from_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    """vLLM's speculative_config (or specray's cascade) for --draft / --ngram / --k / --prompt-lookup-*."""
    if args.speculative_config is not None:
        if args.draft or args.ngram:
            raise ConfigMappingError("--speculative-config: give it or --draft / --ngram, not both")
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            raise ConfigMappingError(f"--speculative-config: not JSON ({exc})") from None
        if not isinstance(spec, dict):
            raise ConfigMappingError("--speculative-config: a JSON object")
        return spec
    n = len(args.draft) + int(args.ngram)
    ks = args.k or [DEFAULT_K]
    if n == 0:
        if args.k:
            raise ConfigMappingError("--num-speculative-tokens: no drafter (give --draft or --ngram)")
        return None
    if len(ks) == 1:
        ks = ks * n
    if len(ks) != n:
        raise ConfigMappingError(f"--num-speculative-tokens: give one for all or one per drafter ({n})")
    drafters: list[dict[str, Any]] = []
    if args.ngram:
        ng: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": ks[0]}
        if args.prompt_lookup_min is not None:
            ng["prompt_lookup_min"] = args.prompt_lookup_min
        if args.prompt_lookup_max is not None:
            ng["prompt_lookup_max"] = args.prompt_lookup_max
        drafters.append(ng)
    drafters += [{"method": "draft_model", "model": m, "num_speculative_tokens": k}
                 for m, k in zip(args.draft, ks[int(args.ngram):])]
    return drafters[0] if n == 1 else {"method": "cascade", "drafters": drafters}


def _level_flags(args: argparse.Namespace, n_model_levels: int) -> dict[str, Any]:
    level: dict[str, Any] = {}
    for flag, field in (("kind", "kind"), ("device", "device"), ("num_cpus", "num_cpus"),
                        ("threads", "num_threads"), ("verify_method", "verify_method"),
                        ("draft_confidence", "draft_confidence"), ("num_gpus", "num_gpus")):
        if getattr(args, flag) is not None:
            level[field] = getattr(args, flag)
    if "num_gpus" not in level and str(level.get("device", "cpu")) != "cpu":
        level["num_gpus"] = 1.0 / max(n_model_levels, 1)  # share one GPU
    return level


def config_from_args(args: argparse.Namespace) -> tuple[AppConfig, dict[str, Any], dict[str, Any]]:
    """(AppConfig, Coordinator deployment options, http options {host, port}) from parsed `specray serve` flags.

    Pure (no Ray): the --config file is the base, MODEL (with the speculation flags) replaces its levels, and every
    other flag given overrides the matching field."""
    from specray.serve.app import app_config_from_args

    base: dict[str, Any] = {}
    options: dict[str, Any] = {}
    http: dict[str, Any] = {}
    if args.config:
        app_args, options, http = _read_config(args.config)
        cfg, more = app_config_from_args(app_args)
        options = {**options, **more}
        base = cfg.model_dump(mode="json", exclude_unset=True)
    elif args.model is None:
        raise ConfigMappingError("give MODEL (the target) or --config")
    spec = speculative_config_from_flags(args)
    if args.model is not None:
        n_model = 1 + len(args.draft)
        flat: dict[str, Any] = {"model": args.model, "level_defaults": _level_flags(args, n_model)}
        if spec is not None:
            flat["speculative_config"] = spec
        new = app_dict_from_vllm(flat)
        cascade = {**(base.get("cascade") or {}), "levels": new["cascade"]["levels"]}
        base["cascade"] = cascade
        base.setdefault("server", {})["model_name"] = new["server"]["model_name"]  # as vLLM: MODEL
    elif spec is not None or args.draft or args.ngram:
        raise ConfigMappingError("--draft / --ngram / --speculative-config need MODEL (the target)")
    levels = base["cascade"]["levels"]
    for lv in levels:
        if lv.get("kind", "hf") == "ngram":
            continue
        if args.max_model_len is not None:
            lv.pop("max_model_len", None)
            lv["max_context"] = args.max_model_len
        if args.dtype is not None and (dt := vllm_dtype(args.dtype, "--dtype")) is not None:
            lv["dtype"] = dt
    server = dict(base.get("server") or {})
    for flag, field in (("served_model_name", "model_name"), ("max_num_seqs", "max_batch_size"),
                        ("api_key", "api_key"), ("in_process", "in_process")):
        if getattr(args, flag) is not None:
            server[field] = getattr(args, flag)
    base["server"] = server
    http = {"host": args.host or http.get("host") or DEFAULT_HOST,
            "port": args.port if args.port is not None else int(http.get("port") or DEFAULT_PORT)}
    return AppConfig.model_validate(base), options, http


# ----------------------------------------------------------------------------------------------- running


def pair_names(names: list[str]) -> list[str]:
    """"drafter->verifier" for each level that verifies one below it (level order)."""
    return [f"{a}->{b}" for a, b in zip(names, names[1:])]


def pull_known_models(cfg: AppConfig) -> None:
    """Pull (download, verify, convert) the known models the levels name, here and with progress bars, so the
    level actors on this machine find them converted."""
    from specray.engine.models import is_pulled, lookup, pull

    for lv in cfg.cascade.levels:
        spec = lookup(lv.model) if lv.model else None
        if spec is not None and not is_pulled(spec.name):
            pull(spec.name, progress=True)


def _wait_with_progress(deploy: threading.Thread, box: dict[str, Any], app_name: str, names: list[str]) -> None:
    """A progress bar while Serve starts the app (the coordinator replica loads every level's model)."""
    from ray import serve
    from tqdm import tqdm

    with tqdm(desc=f"loading {' -> '.join(names)}", unit="s", bar_format="{desc}: {elapsed}{postfix}",
              file=sys.stderr) as bar:
        while deploy.is_alive():
            deploy.join(timeout=1.0)
            try:
                app = serve.status().applications.get(app_name)
                if app is not None:
                    deps = ", ".join(f"{n} {d.status.value if hasattr(d.status, 'value') else d.status}"
                                     for n, d in app.deployments.items())
                    bar.set_postfix_str(deps or str(app.status))
            except Exception:  # status is best effort while the controller starts
                pass
            bar.update(0)
    if "error" in box:
        raise box["error"]


def run_serve(args: argparse.Namespace) -> int:
    """Start Ray and Serve with the app of `args`, print where it listens, block until Ctrl-C / SIGTERM."""
    try:
        cfg, options, http = config_from_args(args)
    except (ConfigMappingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    local = args.address == "local"
    if local and not args.no_pull:
        pull_known_models(cfg)

    import ray
    from ray import serve

    from specray.serve.app import build_coordinator_app

    init: dict[str, Any] = {"address": args.address, "log_to_driver": False, "include_dashboard": False,
                            "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}
    if local:  # enough logical CPUs for every level's reservation (they share the cores)
        need = 0.5 + sum(lv.num_cpus for lv in cfg.cascade.levels if lv.kind != "ngram" and not cfg.server.in_process)
        init["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need))
    else:
        init.pop("include_dashboard")
    names = [lv.display_name for lv in cfg.cascade.levels]

    def _term(signum, frame):  # SIGTERM: stop like Ctrl-C, so what was started is shut down
        raise KeyboardInterrupt

    ray.init(**init)
    signal.signal(signal.SIGTERM, _term)  # after ray.init, which sets a SIGTERM handler of its own (sys.exit)
    try:
        serve.start(http_options=http)
        app = build_coordinator_app(cfg, options)
        box: dict[str, Any] = {}

        def deploy() -> None:
            try:
                serve.run(app, name=args.app_name, route_prefix=args.route_prefix)
            except BaseException as exc:  # reported on the main thread
                box["error"] = exc

        t = threading.Thread(target=deploy, daemon=True)
        t.start()
        try:
            _wait_with_progress(t, box, args.app_name, names)
        except Exception as exc:
            print(f"error: the app did not start: {exc}", file=sys.stderr)
            return 1
        host = http["host"] if http["host"] not in ("0.0.0.0", "::") else "127.0.0.1"
        print(f"specray: serving {cfg.server.model_name!r} ({', '.join(pair_names(names)) or 'plain'}) at "
              f"http://{host}:{http['port']}{args.route_prefix.rstrip('/')}/v1 (OpenAI API); Ctrl-C stops",
              flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("specray: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if not local:  # leave the cluster as it was; a Ray of our own goes with everything in it at once
                serve.delete(args.app_name)
        finally:
            ray.shutdown()
