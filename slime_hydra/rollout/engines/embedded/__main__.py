"""The embedded engine's command line: ``python -m slime_hydra.rollout.engines.embedded --model-path DIR ...`` (flags:
``--help``) loads the model into an ``Engine`` and serves ``build_app`` on ``--host``:``--port`` until interrupted.

The API key comes from the environment (``SLIME_HYDRA_API_KEY``, rollout/auth.py), never from a flag: a command line
is readable by every local user. Without a key the server refuses any host but loopback.
"""

import argparse
import json
import logging
import os
import time

import torch
from aiohttp import web

import slime_hydra.rollout.engines.embedded as package
from slime_hydra.rollout.auth import API_KEY_ENV, LOOPBACK_HOSTS
from slime_hydra.rollout.engines.embedded.scheduler import Engine
from slime_hydra.rollout.engines.embedded.server import build_app

logger = logging.getLogger("slime_hydra.engine")


class _SkipGrpcProbes(logging.Filter):
    """sglang-router first probes a worker over gRPC (an HTTP/2 preface); aiohttp logs each one as a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.rollout.engines.embedded",
                                     description=package.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model's, if any)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU; on CUDA the checkpoint's dtype, else bfloat16")
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="on CUDA, run the decode step eagerly instead of replaying CUDA graphs")
    parser.add_argument("--torch-compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile the decoder layers' decode step and the sampler (auto: on CUDA for "
                             "models without MoE layers)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="prompt + response limit in tokens (default: max_position_embeddings)")
    parser.add_argument("--weight-version", default="0", help="initial weight_version string")
    parser.add_argument("--seed", type=int, default=None, help="seed of the shared sampling generator")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads; default: OMP_NUM_THREADS if set, else all cores but one (the "
                             "HTTP loop needs a core: spinning OpenMP workers on every core stall it for seconds)")
    parser.add_argument("--lora-config", type=json.loads, default=None,
                        help="a PEFT LoRA adapter config as JSON (adapter_config.json's content): serve the model with "
                             "these adapter modules (B = 0 until a weight update sets them, or named adapters of this "
                             "shape loaded by /load_lora_adapter), applied at run time")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="MoE models: answer every /generate with meta_info.routed_experts, the experts each layer "
                             "chose for every token run (slime_hydra/routed_experts.py), for routing replay")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every token as the trainer of algo.true_on_policy does, whatever shares its "
                             "batch (slime_hydra/model/invariant.py): logprobs equal the trainer's bit for bit; no "
                             "torch.compile or stacked projections")
    parser.add_argument("--max-request-mb", type=int, default=4096, help="largest request body accepted")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    args.api_key = os.environ.pop(API_KEY_ENV, None) or None  # popped: no child process inherits it
    if args.api_key is None and args.host not in LOOPBACK_HOSTS:
        parser.error(f"--host {args.host} is reachable from other machines: set {API_KEY_ENV} to the key every "
                     "request must carry (or serve on 127.0.0.1)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_SkipGrpcProbes())
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    started = time.monotonic()
    engine = Engine(args.model_path, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                    cuda_graph=not args.disable_cuda_graph,
                    torch_compile={"auto": None, "on": True, "off": False}[args.torch_compile],
                    context_length=args.context_length, tokenizer_path=args.tokenizer_path,
                    weight_version=args.weight_version, host=args.host, port=args.port, lora=args.lora_config,
                    return_routed_experts=args.enable_return_routed_experts, freeze_heap=True,
                    batch_invariant=args.batch_invariant)
    runner = engine.runner
    logger.info("loaded %s on %s (%s) in %.1f s; tokenizer: %s; pid %d", runner.model_path, runner.device,
                runner.dtype, time.monotonic() - started, runner.tokenizer_path, os.getpid())
    web.run_app(build_app(engine, args.max_request_mb, args.api_key), host=args.host, port=args.port, access_log=None,
                handler_cancellation=True, print=lambda msg: logger.info(msg.strip()))
    # Served and shut down (the app's cleanup ran). End here: the interpreter's teardown would free the memory
    # regions' pools (memory.py) outside a region, which torch_memory_saver answers with exit status 1.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
