"""The vLLM plugin end to end on CPU: real `vllm serve` processes, a real coordinator, the tiny
Gemma-3 (2 layers, random weights, real tokenizer) from `benchmarks.realdata`.

One fleet serves the whole module, to keep vLLM start-ups to a few: server A at TP=1 and
server B at TP=2, both with `--comm-plugin uzip` on one coordinator (so every push goes to three
receivers, chained). Ground truth comes from fresh engines (`uzip_vllm.reference`) loaded with
the pushed weights saved as checkpoints.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import pytest

from conftest import use_vllm_test_env

use_vllm_test_env()  # before vllm is imported

vllm = pytest.importorskip("vllm")
pytest.importorskip("ucxx")
pytest.importorskip("grpc")

import uzip_serve  # noqa: E402
from uzip_serve import p2p  # noqa: E402
from benchmarks import realdata  # noqa: E402
from uzip_vllm import demo  # noqa: E402

PROMPTS = ["Once upon a time, in a small village,", "The capital of France is"]
TOKEN = "vllm-plugin-test-token"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = str(realdata.tiny_dir())
    if not os.path.isdir(model):
        pytest.fail("the tiny model is missing: run `make setup` (python -m benchmarks.realdata)")
    work = tmp_path_factory.mktemp("vllm")
    token_file = work / "token"
    token_file.write_text(TOKEN)
    with ExitStack() as stack:
        coordinator = demo.start_coordinator(stack, work, token_file=token_file, lease=3.0)
        # Both servers boot at once: start-up is mostly Python imports, which overlap well.
        # B forces the compressed TP all-reduce (loopback is too fast for the adaptive switch to pick it).
        procs = {}
        for name, tp, extra in (("a", 1, []), ("b", 2, ["--uzip-allreduce", "always"])):
            procs[name] = stack.enter_context(_Boot(model, work, coordinator, tp, token_file, name, extra))
        urls = {name: boot.wait() for name, boot in procs.items()}
        yield argparse.Namespace(model=model, work=work, coordinator=coordinator, urls=urls, token_file=token_file,
                                 state=realdata_state(model), pushed={})


def realdata_state(model):
    return demo.load_state(model)


class _Boot:
    """Starts `vllm serve` without waiting, so two servers boot in parallel."""

    def __init__(self, model, work, coordinator, tp, token_file, name, extra):
        self.args = (model, work, coordinator, tp, token_file, name, extra)

    def __enter__(self):
        self.stack = ExitStack()
        self.result, self.error = None, None

        def run():
            model, work, coordinator, tp, token_file, name, extra = self.args
            try:
                self.result = demo.start_server(self.stack, model, work, coordinator=coordinator, tp=tp,
                                                token_file=token_file, name=name, extra=extra, timeout=900)
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                self.error = e

        self.thread = threading.Thread(target=run)
        self.thread.start()
        return self

    def wait(self):
        self.thread.join()
        if self.error:
            raise self.error
        return self.result

    def __exit__(self, *exc):
        self.thread.join()
        self.stack.close()


def push(fleet, state, **kw):
    kw.setdefault("token", TOKEN)
    # "auto" sends raw when it measures the link faster than the codec, which on a loaded
    # 2-core CI box it sometimes does; these tests are about the compressed path.
    kw.setdefault("config", p2p.TransportConfig(compression="on"))
    return uzip_serve.push_weights(state, coordinator=fleet.coordinator, progress=False, timeout=60, **kw)


def answers(url, model):
    return [demo.complete(url, model, p, MAX_TOKENS) for p in PROMPTS]


def test_flags_config_and_compile_cache_key(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from uzip_vllm import plugin

    plugin.register()  # idempotent; vLLM already loaded it through the entry point
    parser = argparse.ArgumentParser()
    plugin.add_flags(parser)
    args = parser.parse_args([])
    assert plugin.config_from_args(args) is None
    with pytest.raises(ValueError, match="needs --comm-plugin uzip"):
        plugin.config_from_args(parser.parse_args(["--uzip-coordinator", "h:1"]))
    with pytest.raises(ValueError, match="no such file"):
        plugin.config_from_args(parser.parse_args(["--comm-plugin", "uzip", "--uzip-token-file", "/nonexistent"]))

    on = parser.parse_args(["--comm-plugin", "uzip", "--uzip-coordinator", "127.0.0.1:1", "--uzip-receiver-id", "x"])
    model = str(realdata.tiny_dir())
    base = EngineArgs(model=model, enforce_eager=True, max_model_len=256)
    with_plugin = plugin._apply_flags(EngineArgs(model=model, enforce_eager=True, max_model_len=256), on)
    assert with_plugin.additional_config["uzip"]["coordinator"] == "127.0.0.1:1"
    assert with_plugin.weight_transfer_config.backend == "uzip"
    assert with_plugin.worker_extension_cls == plugin.WORKER_EXTENSION
    h_off = base.create_engine_config().compute_hash()
    h_on = with_plugin.create_engine_config().compute_hash()
    assert h_off != h_on, "the plugin must enter vLLM's compile-cache key"

    clash = EngineArgs(model=model, weight_transfer_config={"backend": "nccl"})
    with pytest.raises(ValueError, match="'uzip' weight-transfer backend"):
        plugin._apply_flags(clash, on)


def test_unsupported_vllm_version_is_a_clear_error(monkeypatch):
    import uzip_vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x.*found vLLM 0\.31\.2"):
        uzip_vllm.check_vllm_version()


def test_pushed_versions_match_fresh_engines_at_tp1_and_tp2(fleet):
    urls, model = fleet.urls, fleet.model
    before = {name: answers(url, model) for name, url in urls.items()}
    assert all(v == 0 for ans in before.values() for _, v in ans)
    served = {}
    state = fleet.state
    for step in (1, 2):
        state = demo.rl_update(state, step)
        res = push(fleet, state)
        assert res.version == step
        assert sorted(res.receivers) == ["a-dp0-pp0-tp0", "b-dp0-pp0-tp0", "b-dp0-pp0-tp1"]
        assert 0 < res.wire_bytes < res.hop_raw_bytes  # compressed on the wire
        for url in urls.values():
            demo.wait_version(url, step)
        served[step] = {name: answers(url, model) for name, url in urls.items()}
        fleet.pushed[step] = demo.save_checkpoint(state, model, fleet.work / f"v{step}")
    fleet.last_state = state

    for name, url in urls.items():
        info = demo.http_json(url + "/uzip/version")[0]
        assert info["version"] == 2 and info["last_error"] is None
        assert all(w["applied"] == 2 for w in info["workers"])

    ckpts = [fleet.pushed[1], fleet.pushed[2]]
    ref1 = demo.reference(ckpts, PROMPTS, tp=1, max_tokens=MAX_TOKENS)
    ref2 = demo.reference(ckpts, PROMPTS, tp=2, max_tokens=MAX_TOKENS)
    for step in (1, 2):
        for name, ref in (("a", ref1), ("b", ref2)):
            texts = [t for t, _ in served[step][name]]
            versions = {v for _, v in served[step][name]}
            assert versions == {step}, f"server {name} stamped {versions} after pushing {step}"
            assert texts == ref[str(fleet.pushed[step])], f"server {name} at version {step} != fresh engine"
    # The pushes changed what the model says (else the comparison above proves little).
    assert [t for t, _ in served[2]["a"]] != [t for t, _ in before["a"]]


def test_tp2_all_reduce_took_the_compressed_ring(fleet):
    """Server B's answers equal a fresh TP=2 engine's without the plugin (previous test), and
    its TP all-reduces really went through the compressed ring, on both workers."""
    answers(fleet.urls["b"], fleet.model)
    workers = demo.http_json(fleet.urls["b"] + "/uzip/allreduce")[0]["workers"]
    assert len(workers) == 2
    for w in workers:
        assert w["compressed"] > 0, w
        assert w["wire_bytes"] > 0 and w["raw_bytes"] > 0, w  # (tiny messages: frame headers can outweigh the gain)
    # Server A runs TP=1: nothing to reduce, so nothing was patched.
    assert all(w["compressed"] == 0 for w in demo.http_json(fleet.urls["a"] + "/uzip/allreduce")[0]["workers"])


def test_failed_pushes_leave_the_previous_version_serving(fleet, corrupt_chunks):
    if 2 not in fleet.pushed:
        pytest.skip("needs the versions pushed by the previous test")
    urls, model = fleet.urls, fleet.model
    good = {name: answers(url, model) for name, url in urls.items()}
    assert all(v == 2 for ans in good.values() for _, v in ans)
    bad_state = demo.rl_update(fleet.last_state, 99)

    # 1. A wrong token: refused before any byte moves.
    with pytest.raises(uzip_serve.PushError) as e:
        push(fleet, bad_state, token="not-the-token")
    assert e.value.code == "UNAUTHENTICATED"

    # 2. A corrupt chunk on the wire: the receivers' checksums fail, the push aborts.
    with corrupt_chunks(0x10), pytest.raises(uzip_serve.PushError):
        push(fleet, bad_state)

    # 3. A receiver dies during the push: another engine of the fleet (a plain WeightReceiver
    #    process), frozen before the push and killed while the trainer is sending to it.
    extra = subprocess.Popen([sys.executable, "-c", _EXTRA_RECEIVER, fleet.coordinator, fleet.model,
                              str(fleet.token_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert extra.stdout.readline().strip() == "registered"
        os.kill(extra.pid, signal.SIGSTOP)
        threading.Timer(1.0, os.kill, args=(extra.pid, signal.SIGKILL)).start()
        with pytest.raises(uzip_serve.PushError):
            push(fleet, bad_state)
    finally:
        extra.kill()
        extra.wait()

    for name, url in urls.items():
        assert answers(url, model) == good[name], f"server {name} changed after failed pushes"
        info = demo.http_json(url + "/uzip/version")[0]
        assert info["version"] == 2

    # Once the dead receiver's lease ran out, the fleet takes the next push.
    time.sleep(3.5)
    res = push(fleet, demo.rl_update(fleet.last_state, 3))
    for url in urls.values():
        demo.wait_version(url, res.version)
        assert {v for _, v in answers(url, model)} == {res.version}


def test_plugin_installed_but_off_changes_nothing(fleet):
    """Fresh engines without --comm-plugin, with the plugin loaded and with it left out
    entirely (VLLM_PLUGINS names only another plugin), answer the same."""
    ckpt = fleet.pushed.get(1) or demo.save_checkpoint(demo.rl_update(fleet.state, 1), fleet.model, fleet.work / "v1")
    # One OMP thread each: the tiny random model's logits are nearly flat, and two 2-thread
    # engines once split a near-tie differently at the 10th token (CI, 2026-12-06).
    one = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    loaded = demo.reference([ckpt], PROMPTS, tp=1, max_tokens=MAX_TOKENS, env=one)
    left_out = demo.reference([ckpt], PROMPTS, tp=1, max_tokens=MAX_TOKENS,
                              env={**one, "VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert loaded == left_out


_EXTRA_RECEIVER = """
import sys, time
from uzip_serve.weights import WeightReceiver
from uzip_vllm.weight_transfer import checkpoint_specs
coordinator, model, token_file = sys.argv[1:4]
r = WeightReceiver(checkpoint_specs(model), coordinator=coordinator, receiver_id="extra",
                   token=open(token_file).read().strip()).start()
print("registered", flush=True)
time.sleep(600)
"""
