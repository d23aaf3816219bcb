"""Run SGLang's own argument handling on command lines and print what it made of them, as JSON.

Run by an SGLang parser environment's interpreter (``make sglang-args-envs``), never by the
pipeline's::

    PYTHONPATH=.sglang-args/<version>:tests/support/torchvision_stub \\
        .venv-vllm/bin/python -S tests/support/sglang_parse.py [--allow-extra-buffer-on-cpu] ARGV_JSON

``ARGV_JSON`` is a file (``-``: stdin) holding a JSON list of argv lists: the server arguments of
``python -m sglang.launch_server``, without the interpreter and the module. Each argv goes through
what ``sglang.launch_server`` does with ``sys.argv[1:]`` before it starts anything, unchanged and
with nothing added: ``prepare_server_args(argv)`` (argparse, and up to 0.5.2x ``ServerArgs.
__post_init__`` with every default, check and model-config lookup), then from 0.5.23 on the
launcher's ``resolve_once()``. Each runs in a process forked after the import, so no argv sees the
global state another one left.

The answer is one JSON object on stdout: ``sglang_version`` and ``results``, one per argv in order:

- ``{"ok": true, "parsed": {...}, "resolved": {...}}``: ``parsed`` holds the fields of ``FIELDS``
  as argparse read them from the argv (the round trip of what the caller set), ``resolved`` as the
  server would run with them (SGLang's defaults, aliases and inferences applied);
- ``{"ok": false, "error": "<exception type>: <message>", "argparse_error": "<argparse's line>",
  ...}`` for an argv SGLang refuses (argparse exits with status 2 and prints the reason).

A field this SGLang version does not have is left out. SGLang's logs and prints go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
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
    "extra_buffer needs CUDA/MUSA/NPU/ROCm (FLA).",  # 0.5.17 ServerArgs._validate_mamba_extra_buffer
    "extra_buffer requires platform support for Mamba cache state snapshots.",  # 0.5.23 mamba_hook
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
            "traceback": traceback.format_exc()[-3000:],
            "log_tail": log[-3000:],
        }
    return {"ok": True, "parsed": fields_of(namespaces[-1]), "resolved": resolved}


def parse_forked(prepare_server_args, argv: list[str]) -> dict:
    """parse_one in a child process, so global state set by one argv's checks (environment
    variables, module globals, memoized configs) cannot leak into the next."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        try:
            payload = json.dumps(parse_one(prepare_server_args, argv)).encode()
        except BaseException as err:  # noqa: BLE001 - the parent must always get an answer
            payload = json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"}).encode()
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"ok": False, "error": f"the parsing process died (wait status {status})"}
    return json.loads(data)


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
    args = sys.argv[1:]
    allow_extra_buffer = bool(args) and args[0] == "--allow-extra-buffer-on-cpu"
    if allow_extra_buffer:
        args = args[1:]
    source = args[0] if args else "-"
    argvs = json.loads(sys.stdin.read() if source == "-" else open(source).read())
    if not isinstance(argvs, list) or not all(isinstance(a, list) for a in argvs):
        raise SystemExit("expected a JSON list of argv lists")
    real_stdout = sys.stdout
    # SGLang prints and logs while importing and checking: stdout is kept for the JSON answer.
    with contextlib.redirect_stdout(sys.stderr):
        import sglang
        from sglang.srt.server_args import prepare_server_args

        if allow_extra_buffer:
            allow_extra_buffer_on_cpu()
        results = [parse_forked(prepare_server_args, argv) for argv in argvs]
    answer = {"sglang_version": getattr(sglang, "__version__", None), "results": results}
    real_stdout.write(json.dumps(answer) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
