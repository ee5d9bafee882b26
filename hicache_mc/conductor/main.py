"""``hicache-mc conductor``: its flags (SGLang's router's where they mean the same) and its
process: one asyncio loop (uvloop when installed) until SIGTERM or Ctrl-C."""
from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger("hicache_mc.conductor")


def add_parser(sub, common) -> None:
    s = sub.add_parser("conductor", help="the Conductor: an OpenAI-compatible router in front of "
                       "SGLang workers, by predicted TTFT")
    common(s)
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (default 30000)")
    s.add_argument("--worker-urls", nargs="+", metavar="URL", help="SGLang workers (prefill and decode in one)")
    s.add_argument("--prefill", nargs="+", action="append", metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a PD prefill worker and, optionally, its bootstrap port (repeat per worker)")
    s.add_argument("--decode", action="append", metavar="URL", help="a PD decode worker (repeat)")
    s.add_argument("--tokenizer", metavar="DIR", help="the served model's tokenizer folder "
                   "(default: none, routing on load alone)")
    s.add_argument("--page-size", type=int, help="tokens per page (default: the workers')")
    s.add_argument("--ttft-slo", type=float, dest="ttft_slo_s", help="seconds (default 2.0)")
    s.add_argument("--tbt-slo", type=float, dest="tbt_slo_s", help="seconds (default 0.1)")
    s.add_argument("--admission", choices=["off", "early", "predictive"],
                   help="reject (429) requests predicted to miss an SLO (default off)")
    s.add_argument("--l3-master", help="the hicache-mc master whose residency view gives the L3")
    s.add_argument("--l3-namespace", help="the deployment's key namespace (the SGLang backend logs it)")
    s.add_argument("--api-key-file", metavar="FILE", help="clients must send this bearer token")
    s.add_argument("--admin-key-file", metavar="FILE", help="the admin API's bearer token (else it is off)")
    s.set_defaults(fn=cmd_conductor)


def config_of(args):
    from ..admin import token_arg
    from ..config import ConductorServerConfig, load_config
    prefill = ",".join(" ".join(p) for p in args.prefill) if args.prefill else None
    return load_config(
        ConductorServerConfig, file=args.config, section="conductor", host=args.host,
        port=args.port, worker_urls=",".join(args.worker_urls) if args.worker_urls else None,
        prefill_urls=prefill, decode_urls=",".join(args.decode) if args.decode else None,
        tokenizer=args.tokenizer, page_size=args.page_size, ttft_slo_s=args.ttft_slo_s,
        tbt_slo_s=args.tbt_slo_s, admission=args.admission, l3_master=args.l3_master,
        l3_namespace=args.l3_namespace, token=token_arg(args),
        api_key="@" + args.api_key_file if args.api_key_file else None,
        admin_key="@" + args.admin_key_file if args.admin_key_file else None)


def cmd_conductor(args) -> int:
    config = config_of(args)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        log.info("uvloop is not installed: the standard asyncio loop serves (slower)")
    return asyncio.run(serve(config))


async def serve(config) -> int:
    from .server import ConductorServer
    server = ConductorServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    log.info("conductor ready on http://%s:%d", config.host, server.port)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    return 0

