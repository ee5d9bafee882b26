"""Live SGLang servers on CPU for the test suite: real ``sglang.launch_server`` processes with
HiCache and hicache-mc's backend (``--hicache-storage-backend hicache_mc``) against a real
``hicache-mc serve``. Tests only: nothing here is part of the package.

API (``tests/`` is on ``sys.path`` in every test, so ``import live``):

- ``tiny_model`` (pytest fixture, session scope, tests/conftest.py): the path of a tiny Qwen2
  with random weights and a trained tokenizer, made once per session under a temporary
  directory (``live.model.make_tiny_model(path, TinyModel(...))`` makes others).
- ``live.model.prompt_ids(n, seed)``: ``n`` token ids; ``prompt_text(n_words, seed)``: text.
  Distinct seeds share no first page.
- ``live.ServerOptions``: page size, host layout, prefetch policy, the backend's extra config,
  ``kv_events=True`` (``--kv-events-config`` on two free ports), ``metrics=True``
  (``--enable-metrics``), extra arguments and environment.
- ``live.start_servers(model, master, workdir, n, options)``: a context manager that starts
  ``n`` servers at once, waits until every one is ready, yields them as a list and stops them
  all on the way out, whatever happened. ``live.SGLangServer(...).start()`` with
  ``live.wait_ready([...])`` does the same by hand, for servers with different options or
  stores (call ``live.build_page_hash()`` first, and stop each with ``.stop()`` in a
  ``finally`` or an ``ExitStack``).
- ``SGLangServer``: ``.url`` (``http://127.0.0.1:<port>``), ``.port``, ``.name``,
  ``.kv_events`` (``KVEventsEndpoints(publisher, replay, topic)``: connect a SUB to
  ``publisher``, a DEALER to ``replay``; None unless asked for), ``.generate(input_ids=... |
  text=..., max_new_tokens, logprob_start_len)`` -> ``Generation`` (output ids, prompt /
  cached / storage tokens, ``storage_backend``, input and output logprobs, the raw
  ``meta_info``), ``.first_token(input_ids)`` -> ``FirstToken(seconds, cached_tokens,
  storage_tokens)`` (streamed: the time to first token), ``.loads()`` (``GET /v1/loads``),
  ``.metrics()`` (``GET /metrics``),
  ``.log()`` (the tail of ``<workdir>/<name>.log``), ``.alive``, ``.stop()``.

Load reports: ``.loads()`` polls ``GET /v1/loads`` (per DP rank: queues, token usage, ...).
SGLang's load PUB (``--load-publish-endpoint``) binds a wildcard host only, never 127.0.0.1, so
the harness leaves it off (``extra_args`` can still turn it on).

Each server is a process group of its own (launcher, scheduler, detokenizer): ``stop()``
signals the group, and a server whose pytest process dies gets SIGKILL from the kernel
(``PR_SET_PDEATHSIG``), so no test leaves one behind. Start servers from the main thread (the
death signal follows the thread that started them).

What makes SGLang 0.5.23 serve on a CPU-only machine (``SGLangServer.command`` and
``.environment``): ``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, ``--attention-backend
torch_native``, no CUDA graphs, and on the servers' ``PYTHONPATH`` only (``SERVER_PATH``):
the torchvision stub (tests/stubs), an ``sgl_kernel`` placeholder and the ``cpu_hicache``
plugin (server_path/cpu_hicache: host pools without cudaHostRegister, the ``direct`` I/O
backend's copies in torch, ``torch.cpu.Stream.synchronize``). SGLang's server dependencies
(fastapi, uvicorn, xgrammar, ...) come from requirements/sglang-cpu.txt.

Example (a module-scoped pair of servers sharing one store)::

    @pytest.fixture(scope="module")
    def pair(tiny_model, tmp_path_factory):
        store = Store(tmp_path_factory.mktemp("store")).start()     # tests/procs.py
        try:
            with live.start_servers(tiny_model, store.master, tmp_path_factory.mktemp("srv"),
                                    n=2, options=live.ServerOptions(kv_events=True)) as servers:
                yield store, servers
        finally:
            store.stop()

A server takes about a minute to start on two busy cores and holds about 2 GiB (three
processes); keep them module-scoped.
"""
from .model import TinyModel, make_tiny_model, prompt_ids, prompt_text
from .server import (FirstToken, Generation, KVEventsEndpoints, SGLangServer, ServerOptions,
                     build_page_hash, start_servers, wait_ready)

__all__ = ["FirstToken", "Generation", "KVEventsEndpoints", "SGLangServer", "ServerOptions",
           "TinyModel", "build_page_hash", "make_tiny_model", "prompt_ids", "prompt_text",
           "start_servers", "wait_ready"]
