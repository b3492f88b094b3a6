"""``llama-metaws serve``'s web page, as a browser asks for it: the chat page at ``/`` (the package's
own file, which streams from ``/v1/chat/completions``), the paths a browser that knew
llama-server's web UI asks for, none behind ``--api-key``; the page's script chatting with the
server (run by Node.js on a stand-in for the page's elements, where Node is installed);
``--no-ui`` serves no page (404) but still the service worker that removes itself."""

import json
import shutil
import subprocess
from importlib import resources

import pytest

import llama_metaws
from llama_metaws_dev.testing import make_tiny_model
from serving import Server

KEY = "sk-ui-test"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def model(models_dir):
    return make_tiny_model(models_dir / "ui-chars.gguf", seed=55, vocab="chars", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = Server(model, "-c", "256", api_key=KEY, log_path=tmp_path_factory.mktemp("ui") / "ui.log")
    yield from srv.running()


def test_the_chat_page_and_its_assets_are_served_without_the_key(server):
    page = resources.files("llama_metaws.server").joinpath("ui", "index.html").read_bytes()
    for path in ("/", "/index.html"):
        status, headers, body = server.request("GET", path)
        assert status == 200 and headers["content-type"].startswith("text/html") and body == page
    text = page.decode()
    assert text.startswith("<!doctype html>") and "v1/chat/completions" in text and "stream: true" in text
    status, headers, body = server.request("GET", "/sw.js")
    assert status == 200 and headers["content-type"].startswith("application/javascript")
    assert b"unregister()" in body
    status, _, body = server.request("GET", "/manifest.webmanifest")
    assert status == 200 and b'"start_url"' in body
    status, _, body = server.request("GET", "/_app/version.json")
    assert status == 200 and llama_metaws.__version__ in body.decode()
    # the API keeps its key
    assert server.request("GET", "/v1/models")[0] == 401
    status, _, _ = server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    # what the page sends: a streamed chat with the key it was given
    events = server.events("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                    "max_tokens": 4, "timings_per_token": True},
                           headers={"Authorization": f"Bearer {KEY}"})
    assert events[-1] == "[DONE]" and any("timings" in e for e in events[:-1])


# the page's elements, as far as its script touches them, and fetch resolved against the server
_NODE_HARNESS = r"""
const [page, base, key] = process.argv.slice(1);
class El {
  constructor() { this.children = []; this.text = ""; this.value = ""; this.parts = {}; }
  set textContent(v) { this.text = v; if (v === "") this.children = []; }
  get textContent() { return this.text + this.children.map((c) => c.textContent).join(""); }
  set innerHTML(v) {
    this.parts = { b: new El(), ".thinking": new El(), ".text": new El() };
    this.children = Object.values(this.parts);
  }
  querySelector(selector) { return this.parts[selector]; }
  appendChild(child) { this.children.push(child); }
  addEventListener() {}
}
const els = {};
global.document = { getElementById: (id) => (els[id] ||= new El()), createElement: () => new El() };
global.localStorage = { getItem: () => key, setItem() {} };
const realFetch = fetch;
global.fetch = (url, opts) => realFetch(new URL(url, base), opts);
eval(require("fs").readFileSync(page, "utf8").split("<script>")[1].split("</script>")[0]);
(async () => {
  await new Promise((resolve) => setTimeout(resolve, 500));
  els.input.value = "hello";
  await els.form.onsubmit({ preventDefault() {} });
  console.log(JSON.stringify({ model: els.model.textContent, log: els.log.textContent, stats: els.stats.textContent }));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js runs the page's script")
def test_the_page_s_script_streams_a_chat_with_the_key(server):
    page = resources.files("llama_metaws.server").joinpath("ui", "index.html")
    with resources.as_file(page) as path:
        res = subprocess.run(["node", "-e", _NODE_HARNESS, str(path), server.base + "/", KEY], capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    shown = json.loads(res.stdout)
    assert shown["model"] == "· ui-chars.gguf"  # GET v1/models, with the key
    assert shown["log"].startswith("userhelloassistant") and len(shown["log"]) > len("userhelloassistant")
    assert shown["stats"].startswith("prompt ") and " tokens, " in shown["stats"]  # timings_per_token


def test_no_ui_serves_no_page_but_the_worker_that_removes_itself(model, tmp_path):
    srv = Server(model, "-c", "256", "--no-ui", log_path=tmp_path / "no-ui.log")
    try:
        for path in ("/", "/index.html", "/manifest.webmanifest", "/_app/version.json"):
            assert srv.request("GET", path)[0] == 404, path
        status, _, body = srv.request("GET", "/sw.js")
        assert status == 200 and b"unregister()" in body
        assert srv.json("POST", "/completion", {"prompt": "hi", "n_predict": 2})[0] == 200
    finally:
        srv.kill()
    assert "Traceback" not in srv.log()
