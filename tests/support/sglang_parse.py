"""Run SGLang's own argument handling on command lines and print what it made of them, as JSON.

Run by an SGLang parser environment's interpreter (``make sglang-args-envs``), never by the
pipeline's::

    PYTHONPATH=.sglang-args/<version>:tests/support/torchvision_stub \\
        .venv-vllm/bin/python -S tests/support/sglang_parse.py \\
        [--allow-extra-buffer-on-cpu] [--report-imports] ARGV_JSON

``ARGV_JSON`` is a file (``-``: stdin) holding a JSON list of argv lists: the server arguments of
``python -m sglang.launch_server``, without the interpreter and the module. An item may also be
``{"argv": [...], "allow_extra_buffer_on_cpu": true}``: that argv alone gets the allowance of
``allow_extra_buffer_on_cpu`` (the command-line flag gives it to every argv).

Each argv goes through what ``sglang.launch_server`` does with ``sys.argv[1:]`` before it starts
anything, unchanged and with nothing added: ``prepare_server_args(argv)`` (argparse; in 0.5.17
also ``ServerArgs.__post_init__``, with every default, check and model-config lookup), then, where
the version has it (0.5.23), the launcher's ``resolve_once()``, which does that work there. Each
argv runs in a process forked after the import (as many at once as there are CPUs), so none sees
the global state another one left.

The answer is one JSON object on stdout: ``sglang_version`` and ``results``, one per argv in order:

- ``{"ok": true, "parsed": {...}, "resolved": {...}, "deprecations": [...]}``: ``parsed`` holds
  the fields of ``FIELDS`` as argparse read them from the argv (the round trip of what the caller
  set), ``resolved`` as the server would run with them (SGLang's defaults, aliases and inferences
  applied), ``deprecations`` SGLang's warnings about deprecated flags of the argv;
- ``{"ok": false, "error": "<exception type>: <message>", "argparse_error": "<argparse's line>",
  ...}`` for an argv SGLang refuses (argparse exits with status 2 and prints the reason).

A field this SGLang version does not have is left out. SGLang's logs and prints go to stderr.
``--report-imports`` adds ``imported_distributions``: the distributions of every top-level module
imported (by importing SGLang or by any parse), i.e. what envs/sglang-<version>-args.txt must
install besides torch's own requirements.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import traceback

# The ServerArgs fields the project sets or relies on.
FIELDS = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "dp_size",
    "mem_fraction_static",
    "reasoning_parser",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "speculative_dflash_block_size",
    "mamba_scheduler_strategy",
    "mamba_radix_cache_strategy",
    "context_length",
    "device",
)
# The platform checks that --allow-extra-buffer-on-cpu answers, by version.
EXTRA_BUFFER_PLATFORM_REFUSALS = (
    # 0.5.17: ServerArgs._validate_mamba_extra_buffer
    "extra_buffer needs CUDA/MUSA/NPU/ROCm (FLA).",
    # 0.5.23: sglang/srt/arg_groups/mamba_hook.py validate_mamba_extra_buffer
    "extra_buffer requires platform support for Mamba cache state snapshots.",
)


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def fields_of(obj) -> dict:
    found = {}
    for name in FIELDS:
        try:
            found[name] = _jsonable(getattr(obj, name))
        except AttributeError:
            pass
    return found


def resolve(args):
    """What the server runs with, as ``sglang.launch_server`` gets it: from 0.5.23 on,
    ``prepare_server_args`` returns the raw input and the launcher resolves it (``resolve_once``,
    then reads ``resolving_view``); before, ``__post_init__`` resolved it in place."""
    if not hasattr(args, "resolve_once"):
        return args
    from sglang.srt.arg_groups.overrides import resolving_view

    args.resolve_once()
    return resolving_view(args)


@contextlib.contextmanager
def capture_namespaces(into: list):
    """Record every namespace argparse returns (SGLang's parser is built inside
    prepare_server_args; its namespace is what the argv said, before any resolution)."""
    parse_args = argparse.ArgumentParser.parse_args

    def recording(self, *args, **kwargs):
        namespace = parse_args(self, *args, **kwargs)
        into.append(namespace)
        return namespace

    argparse.ArgumentParser.parse_args = recording
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = parse_args


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def deprecations(log: str) -> list[str]:
    """SGLang's deprecation warnings in a captured log (its argparse actions log one per
    deprecated flag the argv uses), colour codes removed."""
    return [ANSI.sub("", line).strip() for line in log.splitlines() if "deprecated" in line]


def imported_distributions() -> list[str]:
    """The distributions that provide the top-level modules imported so far (what the
    requirement file must hold)."""
    import importlib.metadata as metadata

    provided = metadata.packages_distributions()
    names = {module.split(".")[0] for module in list(sys.modules)}
    return sorted({dist for name in names for dist in provided.get(name, ())})


def parse_one(prepare_server_args, argv: list[str]) -> dict:
    """The result dict of one argv (see the module docstring); never raises."""
    stderr = io.StringIO()
    namespaces: list = []
    stage = "parse"
    try:
        with contextlib.redirect_stderr(stderr), capture_namespaces(namespaces):
            args = prepare_server_args(list(argv))
            stage = "resolve"
            resolved = fields_of(resolve(args))
    except BaseException as err:  # argparse exits (SystemExit); checks raise anything
        log = stderr.getvalue()
        errors = [line for line in log.splitlines() if ": error: " in line]
        return {
            "ok": False,
            "stage": stage,
            "error": f"{type(err).__name__}: {str(err) or repr(err)}",
            "argparse_error": errors[-1] if errors else None,
            "parsed": fields_of(namespaces[-1]) if namespaces else None,
            "deprecations": deprecations(log),
            "traceback": traceback.format_exc()[-3000:],
            "log_tail": log[-3000:],
        }
    return {
        "ok": True,
        "parsed": fields_of(namespaces[-1]),
        "resolved": resolved,
        "deprecations": deprecations(stderr.getvalue()),
    }


def parse_in_child(
    prepare_server_args, argv: list[str], allow_extra_buffer: bool, report_imports: bool, out: str
) -> int:
    """Fork a child that runs parse_one and writes its result to the file ``out``; its pid. The
    child's global state (set by one argv's checks: environment variables, module globals,
    memoized configs; or by the extra_buffer allowance) dies with it."""
    pid = os.fork()
    if pid:
        return pid
    try:
        if allow_extra_buffer:
            allow_extra_buffer_on_cpu()
        result = parse_one(prepare_server_args, argv)
        if report_imports:
            result["imported_distributions"] = imported_distributions()
    except BaseException as err:  # noqa: BLE001 - the parent must always get an answer
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    with open(out, "w") as file:
        json.dump(result, file)
    os._exit(0)


def parse_all(prepare_server_args, jobs: list[tuple[list[str], bool]], report_imports: bool):
    """Each (argv, allow_extra_buffer) of ``jobs`` parsed in a child of its own, as many at once
    as there are CPUs; the results in order."""
    import tempfile

    parallel = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory(prefix="sglang-parse-") as folder:
        outs = [os.path.join(folder, f"{index}.json") for index in range(len(jobs))]
        running: dict[int, int] = {}  # pid: index
        statuses: dict[int, int] = {}
        pending = list(enumerate(jobs))
        while pending or running:
            while pending and len(running) < parallel:
                index, (argv, allow) = pending.pop(0)
                pid = parse_in_child(prepare_server_args, argv, allow, report_imports, outs[index])
                running[pid] = index
            pid, status = os.wait()
            if pid in running:
                statuses[running.pop(pid)] = status
        results = []
        for index, out in enumerate(outs):
            try:
                with open(out) as file:
                    results.append(json.load(file))
            except (OSError, ValueError):
                results.append(
                    {
                        "ok": False,
                        "error": f"the parsing process died (wait status {statuses[index]})",
                    }
                )
        return results


def allow_extra_buffer_on_cpu() -> None:
    """Let SGLang's mamba ``extra_buffer`` check pass its platform test on this CPU machine.

    A hybrid (Gated-DeltaNet) target's mamba radix cache resolves to ``extra_buffer`` whenever the
    overlap scheduler is on (the default), and the project's DFlash server asks for it outright;
    SGLang then asks torch, not ``--device``, whether the platform can snapshot the mamba state,
    and a CPU torch fails that whatever the flags say (``EXTRA_BUFFER_PLATFORM_REFUSALS``). Only
    that platform test is answered "yes": the other extra_buffer checks (the architecture supports
    it, the mamba track interval covers the draft tokens, ...) and everything else run unchanged.
    """
    try:  # 0.5.23: the resolution hooks
        from sglang.srt.arg_groups import mamba_hook
    except ImportError:
        mamba_hook = None
    if hasattr(mamba_hook, "_platform_supports_mamba_cache_extra_buffer"):
        mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
        return
    import sglang.srt.server_args as module  # 0.5.17: is_cuda() inside the validation

    validate = getattr(module.ServerArgs, "_validate_mamba_extra_buffer", None)
    if validate is None:
        raise SystemExit("no extra_buffer platform check known in this SGLang version")

    def validate_as_on_cuda(self, *args, **kwargs):
        is_cuda = module.is_cuda
        module.is_cuda = lambda: True
        try:
            return validate(self, *args, **kwargs)
        finally:
            module.is_cuda = is_cuda

    module.ServerArgs._validate_mamba_extra_buffer = validate_as_on_cuda


def main() -> int:
    options = {"--allow-extra-buffer-on-cpu", "--report-imports"}
    given = {arg for arg in sys.argv[1:] if arg in options}
    args = [arg for arg in sys.argv[1:] if arg not in options]
    allow_extra_buffer = "--allow-extra-buffer-on-cpu" in given
    report_imports = "--report-imports" in given
    source = args[0] if args else "-"
    items = json.loads(sys.stdin.read() if source == "-" else open(source).read())
    if not isinstance(items, list):
        raise SystemExit("expected a JSON list of argv lists")
    jobs = []
    for item in items:
        if isinstance(item, dict):
            jobs.append((item["argv"], bool(item.get("allow_extra_buffer_on_cpu"))))
        elif isinstance(item, list):
            jobs.append((item, allow_extra_buffer))
        else:
            raise SystemExit(f"not an argv list: {item!r}")
    real_stdout = sys.stdout
    # SGLang prints and logs while importing and checking: stdout is kept for the JSON answer.
    with contextlib.redirect_stdout(sys.stderr):
        import sglang
        from sglang.srt.server_args import prepare_server_args

        results = parse_all(prepare_server_args, jobs, report_imports)
    answer = {"sglang_version": getattr(sglang, "__version__", None), "results": results}
    if report_imports:  # what envs/sglang-<version>-args.txt must hold (with torch's requirements)
        imported = set(imported_distributions())
        for result in results:
            imported.update(result.pop("imported_distributions", ()))
        answer["imported_distributions"] = sorted(imported)
    real_stdout.write(json.dumps(answer) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
