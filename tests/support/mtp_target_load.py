"""Load a target with an MTP head into an engine's own model classes (on a CPU), as JSON.

Run by an engine environment's interpreter, never by the pipeline's::

    .venv-vllm/bin/python tests/support/mtp_target_load.py vllm MODEL_DIR
    PYTHONPATH=.sglang-args/<version>:tests/support/torchvision_stub \\
        .venv-vllm/bin/python -S tests/support/mtp_target_load.py sglang MODEL_DIR

Each engine resolves the target and its MTP draft model from the target's folder as its server
does with MTP on (vLLM ``--speculative-config '{"method": "mtp", ...}'``, SGLang
``--speculative-algorithm NEXTN``), builds both models (one process, a one-rank gloo group) and
loads the checkpoint's tensors with each model's own ``load_weights``. The answer, on the last
line of stdout: per model its class, its parameters, and the parameters no tensor wrote.

- vLLM: each model built as its loader builds it, then its ``load_weights``, which refuses a
  checkpoint name the model does not map and returns the parameters it wrote (vLLM's default
  loader fails on any other: "Following weights were not initialized from checkpoint").
- SGLang: its parameters are set to NaN first, so a parameter still NaN after ``load_weights``
  is one no checkpoint tensor reached (SGLang's loaders fail only on a name they map to no
  parameter). SGLang serves on a GPU only; building the models on a CPU needs two stand-ins: a
  CPU device in the server arguments, and a placeholder for the vLLM rotary kernel its rotary
  embedding imports off CUDA (never called: nothing runs forward). Written against SGLang 0.5.17;
  0.5.23 builds its tensor-parallel state otherwise (a rank bundle) and is not set up here.
"""

from __future__ import annotations

import json
import socket
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def checkpoint(model_dir: str):
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def vllm_models(model_dir: str) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    engine_args = EngineArgs(
        model=model_dir,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        max_model_len=512,
        enforce_eager=True,
    )
    config = engine_args.create_engine_config()
    draft_config = config.speculative_config.draft_model_config
    weights = checkpoint(model_dir)
    answer = {}
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        for role, model_config in (("target", config.model_config), ("draft", draft_config)):
            with set_default_torch_dtype(model_config.dtype):
                model = initialize_model(vllm_config=config, model_config=model_config, prefix=role)
            # What vLLM's default loader does with the checkpoint's tensors; a name the model
            # does not map fails here (AutoWeightsLoader), a parameter none wrote is reported.
            loaded = model.load_weights(iter(weights.items()))
            params = sorted(name for name, _ in model.named_parameters())
            answer[role] = {
                "class": type(model).__name__,
                "architectures": list(model_config.hf_config.architectures),
                "params": params,
                "unwritten": sorted(set(params) - set(loaded)),
            }
    return answer


def sglang_models(model_dir: str) -> dict:
    import types

    import torch

    # The rotary embedding's import off CUDA (module docstring): a placeholder, never called.
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = None
    sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm._custom_ops": ops})

    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: F401 (registers NEXTN)

    server_args = prepare_server_args(
        ["--model-path", model_dir, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2", "--device", "cpu"]
    )  # fmt: skip
    runtime_context.publish(server_args, role="test")
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"
    )
    parallel_state.initialize_model_parallel(backend="gloo")  # sizes: 1 by default (0.5.23: no size arguments)
    weights = checkpoint(model_dir)
    answer = {"resolved_algorithm": server_args.speculative_algorithm}
    # The draft worker's model path: the draft path, which SGLang leaves unset for MiMo and then
    # takes the target's (ModelConfig.from_server_args).
    answer["draft_model_path"] = server_args.speculative_draft_model_path
    for role, draft in (("target", False), ("draft", True)):
        model_config = ModelConfig.from_server_args(
            server_args, model_path=server_args.speculative_draft_model_path if draft else None, is_draft_model=draft
        )
        model_class, _ = get_model_architecture(model_config)
        model = model_class(model_config.hf_config)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        model.load_weights(iter(weights.items()))
        params = dict(model.named_parameters())
        answer[role] = {
            "class": model_class.__name__,
            "architectures": list(model_config.hf_config.architectures),
            "params": sorted(params),
            "unwritten": sorted(name for name, p in params.items() if torch.isnan(p).any()),
        }
    return answer


def main() -> int:
    engine, model_dir = sys.argv[1:3]
    answer = {"vllm": vllm_models, "sglang": sglang_models}[engine](model_dir)
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
