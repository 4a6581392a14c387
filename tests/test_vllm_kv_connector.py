"""UzipConnector end to end on CPU: a real prefill + decode pair of `vllm serve` processes with
the tiny Gemma-3 (2 layers, random weights, real tokenizer), the `uzip_vllm.disagg` proxy in
this process. One pair serves the module (each vLLM start-up costs about a minute here).

Ground truth is the prefill instance asked directly (a plain single instance: it takes part in
a transfer only when a request carries `kv_transfer_params`), before any disaggregated request.
The senders sleep `test_layer_delay_s` before each layer, so a transfer lasts long enough for
the kill test to kill the prefill instance while layers are on the way.
"""

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from contextlib import ExitStack

import pytest

from conftest import use_vllm_test_env

use_vllm_test_env()  # before vllm is imported

vllm = pytest.importorskip("vllm")
pytest.importorskip("ucxx")
pytest.importorskip("aiohttp")

from benchmarks import realdata  # noqa: E402
from uzip_vllm import demo, disagg, kv_connector  # noqa: E402

PROMPTS = ["Once upon a time, in a small village, there lived an old clockmaker who",
           "The capital of France is",
           " ".join(f"word{i}" for i in range(150))]  # spans many 16-token blocks
MAX_TOKENS = 12
LAYER_DELAY_S = 0.4
LOAD_TIMEOUT_S = 15.0


def _post(url, body, timeout=120):
    return demo.http_json(url + "/v1/completions", body, timeout=timeout)[0]


def _complete(url, model, prompt, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return _post(url, body)["choices"][0]["text"]


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _counters(pair_ns, role):
    path = os.path.join(pair_ns.stats_dir, f"{role}-tp0.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"counters": {}, "xfers": {}}


def _p2p_hits(metrics_text):
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="p2p"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = str(realdata.tiny_dir())
    if not os.path.isdir(model):
        pytest.fail("the tiny model is missing: run `make setup` (python -m benchmarks.realdata)")
    work = tmp_path_factory.mktemp("disagg")
    with ExitStack() as stack:
        p = disagg.start_pair(stack, model, work, compression="on", policy="recompute",
                              extra_extra={"load_timeout_s": LOAD_TIMEOUT_S, "test_layer_delay_s": LAYER_DELAY_S})
        proxy = disagg.Proxy(p.prefill_url, p.decode_url, p.stats_dir)
        port = demo.free_port()
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        t = threading.Thread(target=lambda: loop.run_until_complete(
            disagg.serve_proxy(proxy, "127.0.0.1", port, stop)), daemon=True)
        t.start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                _get(url + "/uzip/disagg/stats")
                break
            except OSError:
                time.sleep(0.1)
        stack.callback(lambda: (loop.call_soon_threadsafe(stop.set), t.join(10)))
        ref = {prompt: _complete(p.prefill_url, model, prompt) for prompt in PROMPTS}
        yield type("Pair", (), dict(model=model, proxy=url, prefill_url=p.prefill_url, decode_url=p.decode_url,
                                    stats_dir=p.stats_dir, prefill_proc=p.prefill_proc, ref=ref, work=work))


def test_greedy_outputs_equal_single_instance(pair):
    for prompt in PROMPTS:
        assert _complete(pair.proxy, pair.model, prompt) == pair.ref[prompt], prompt
    # Streaming goes through the proxy too.
    body = {"model": pair.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    req = urllib.request.Request(pair.proxy + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == pair.ref[PROMPTS[0]]


def test_decode_used_transferred_kv(pair):
    before = _counters(pair, "decode")["counters"]
    hits_before = _p2p_hits(_get(pair.decode_url + "/metrics"))
    prompt = PROMPTS[2] + " again"
    assert _complete(pair.proxy, pair.model, prompt) == _complete(pair.prefill_url, pair.model, prompt)
    after = _counters(pair, "decode")["counters"]
    # The decode worker wrote transferred blocks into its cache ...
    assert after.get("loads_ok", 0) == before.get("loads_ok", 0) + 1
    assert after.get("tokens_loaded", 0) > before.get("tokens_loaded", 0) + 100
    assert after.get("recv_wire_bytes", 0) > before.get("recv_wire_bytes", 0)
    # ... and vLLM's own counter attributes those prompt tokens to a p2p transfer.
    assert _p2p_hits(_get(pair.decode_url + "/metrics")) > hits_before
    # The proxy's stats route exposes the same counters.
    stats = json.loads(_get(pair.proxy + "/uzip/disagg/stats"))
    assert stats["workers"]["decode-tp0"]["loads_ok"] >= 1
    assert stats["workers"]["prefill-tp0"]["sends_ok"] >= 1


def test_prefill_killed_mid_transfer_recomputes(pair):
    """Last in the module: it kills the prefill instance."""
    before = _counters(pair, "decode")["counters"]
    sent_before = len(_counters(pair, "prefill")["xfers"])
    prompt = PROMPTS[2] + " killed"
    want = _complete(pair.decode_url, pair.model, prompt)  # decode alone, no transfer
    result = {}

    def run():
        t0 = time.monotonic()
        try:
            result["text"] = _complete(pair.proxy, pair.model, prompt)
        except Exception as e:  # noqa: BLE001
            result["error"] = e
        result["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    # The prefill worker notes a transfer when its forward is done; its sender then spends
    # LAYER_DELAY_S before each layer: kill it in that window.
    deadline = time.monotonic() + 60
    while len(_counters(pair, "prefill")["xfers"]) == sent_before:
        assert time.monotonic() < deadline, "the prefill instance never started the transfer"
        time.sleep(0.05)
    os.killpg(pair.prefill_proc.pid, signal.SIGKILL)
    th.join(LOAD_TIMEOUT_S + 60)
    assert not th.is_alive(), "the request hung after the prefill instance died"
    # Recomputed (policy "recompute"): the right answer, within the load deadline plus compute.
    assert "error" not in result, result
    assert result["text"] == want
    after = _counters(pair, "decode")["counters"]
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0) + 1
    assert after.get("loads_ok", 0) == before.get("loads_ok", 0)
    # The decode instance keeps serving.
    assert _complete(pair.decode_url, pair.model, PROMPTS[1]) == pair.ref[PROMPTS[1]]


# ---- no vLLM start-up: the control messages and the layout check ---------------------------------

def test_hello_roundtrip_and_validation():
    h = kv_connector.Hello(kv_connector.KIND_TRANSFER, 2, 1, 18, 1, 16, 1000, 63, 8192, "ab" * 16)
    assert len(h.pack()) == kv_connector.HELLO.size == 68
    assert kv_connector.Hello.unpack(h.pack()) == h
    bad = bytearray(h.pack())
    bad[0:4] = b"XXXX"
    with pytest.raises(ValueError, match="magic"):
        kv_connector.Hello.unpack(bytes(bad))
    with pytest.raises(ValueError):
        kv_connector.Hello.unpack(h.pack()[:-1])
    assert kv_connector.unpack_reply(kv_connector.pack_reply(None)) is None
    assert "TP" in kv_connector.unpack_reply(kv_connector.pack_reply("TP differs"))


def test_different_tp_is_refused():
    import torch

    c = kv_connector.UzipConnector.__new__(kv_connector.UzipConnector)
    c._tp_size, c._tp_rank, c._block_size = 1, 0, 16
    c._layer_names, c._dtype, c._page_nbytes = ["a", "b"], torch.bfloat16, 8192
    ok = c._hello(kv_connector.KIND_PROBE)
    assert c._check_hello(ok) is None
    tp2 = kv_connector.Hello(kv_connector.KIND_PROBE, 2, 0, 2, 1, 16, 0, 0, 8192, "")
    assert "tensor-parallel sizes differ" in c._check_hello(tp2)
    other_layout = kv_connector.Hello(kv_connector.KIND_PROBE, 1, 0, 2, 1, 32, 0, 0, 8192, "")
    assert "block_size" in c._check_hello(other_layout)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="peer"):
        kv_connector.parse_config({}, "kv_producer")
    with pytest.raises(ValueError, match="unknown"):
        kv_connector.parse_config({"bogus": 1}, "kv_consumer")
    with pytest.raises(ValueError, match="kv_both|kv_role"):
        kv_connector.parse_config({}, "kv_both")
    cfg = kv_connector.parse_config({"peer": "h:5", "load_timeout_s": 3}, "kv_producer")
    assert cfg.peer_host_port == ("h", 5) and cfg.load_timeout_s == 3.0
