"""The HTML report in a real browser: headless Chromium, driven over the DevTools protocol.

It needs Chromium (Debian: ``apt-get install chromium``, which gives /usr/bin/chromium; or set
ATTNKIT_CHROMIUM to a Chromium/Chrome binary); without it the test fails in one line that says
so. No Python package is
needed: the DevTools protocol runs over a pair of pipes (``--remote-debugging-pipe``: the
browser reads commands on fd 3 and writes replies on fd 4, each a JSON message ending in NUL).
The browser gets a fresh profile directory and every network-related feature switched off.
"""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from attnkit.explain import attention_sections, render_attention_html

CHROMIUM = (
    os.environ.get("ATTNKIT_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
)
pytestmark = pytest.mark.needs("chromium")  # a missing browser fails in one line, everywhere

HOSTILE = "<img src=x onerror=\"document.body.setAttribute('data-pwned', '1')\">"
CLOSER = "</script><script>document.body.setAttribute('data-pwned', '2')</script>"


class Browser:
    """A headless Chromium with one page, spoken to over --remote-debugging-pipe."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="attnkit-chromium-")
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # fds of 10 and up, so that moving them to 3 and 4 in the child cannot clobber them
        read_end = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        write_end = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)
        args = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.process = subprocess.Popen(
            [
                "bash",
                "-c",
                f'exec "$@" 3<&{read_end} 4>&{write_end} {read_end}<&- {write_end}>&-',
                "bash",
                *args,
            ],
            pass_fds=(read_end, write_end),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(read_end)
        os.close(write_end)
        self._out, self._in = to_browser_w, from_browser_r
        self._buffer = b""
        self._id = 0
        self.session = None

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the page (not about:blank) has loaded
            try:
                if self.js("document.readyState === 'complete' && location.protocol === 'file:'"):
                    return
            except RuntimeError:  # the context is replaced while navigating
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{url} did not load")

    def js(self, expression: str):
        params = {"expression": expression, "awaitPromise": True, "returnByValue": True}
        result = self.send("Runtime.evaluate", params, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Save what the page shows as a PNG."""
        data = self.send("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()  # only the process this test started
            self.process.wait(timeout=10)
        for fd in (self._out, self._in):
            os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser():
    b = Browser(CHROMIUM)
    try:
        yield b
    finally:
        b.close()


def weights(*shape: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1)


DRAWN = "[...document.querySelectorAll('#attention-grid td')].map(td => Number(td.dataset.weight))"


def test_report_draws_selects_and_hovers_in_chromium(tmp_path: Path, browser: Browser):
    src = ["今天", "下雨", HOSTILE, CLOSER]
    tgt = ["<s>", "it", "rains"]
    enc = weights(1, 2, 3, 4, 4, seed=0)  # (B, L, H, N, M): split into layers below
    dec = weights(1, 2, 3, 3, 3, seed=1)
    cross = weights(1, 2, 3, 3, 4, seed=2)
    attentions = {
        "encoder": [enc[:, layer] for layer in range(2)],
        "decoder": [dec[:, layer] for layer in range(2)],
        "cross": [cross[:, layer] for layer in range(2)],
    }
    sections = attention_sections(attentions, src_tokens=src, tgt_tokens=tgt)
    picture = tmp_path / "p.png"
    picture.write_bytes(
        bytes.fromhex(  # a valid 1 x 1 PNG
            "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
            "1f15c4890000000d49444154789c6360f8cfc0f01f0005000201e2b2a02a0000000049454e44ae426082"
        )
    )
    report = render_attention_html(sections, tmp_path / "report.html", images=[picture])

    browser.open(report.as_uri() + "#section=2&layer=1&head=1")
    # the address chose cross-attention, layer 1, head 1: its weights are what is drawn
    assert browser.js("document.getElementById('section-select').value") == "2"
    drawn = torch.tensor(browser.js(DRAWN), dtype=torch.float64)
    torch.testing.assert_close(drawn, cross[0, 1, 1].double().reshape(-1), atol=6e-5, rtol=0)

    # choosing another head redraws the grid with that head's weights
    browser.js(
        "const s = document.getElementById('head-select'); s.value = '0';"
        "s.dispatchEvent(new Event('change')); true"
    )
    drawn0 = torch.tensor(browser.js(DRAWN), dtype=torch.float64)
    torch.testing.assert_close(drawn0, cross[0, 1, 0].double().reshape(-1), atol=6e-5, rtol=0)
    assert not torch.allclose(drawn0, drawn)
    assert browser.js("location.hash") == "#section=2&layer=1&head=0"

    # hovering a cell highlights its row and lists that query's weights, as text
    browser.js(
        "document.querySelector('#attention-grid tr[data-row=\"2\"] td')"
        ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true})); true"
    )
    assert browser.js("document.querySelector('#attention-grid tr.active th').textContent") == (
        "rains"
    )
    listed = browser.js(
        "[...document.querySelectorAll('#row-weights td.weight')].map(td => Number(td.textContent))"
    )
    torch.testing.assert_close(
        torch.tensor(listed, dtype=torch.float64), cross[0, 1, 0, 2].double(), atol=6e-5, rtol=0
    )

    # the encoder section shows the hostile tokens as text, and they never ran
    browser.js(
        "const t = document.getElementById('section-select'); t.value = '0';"
        "t.dispatchEvent(new Event('change')); true"
    )
    keys = browser.js(
        "[...document.querySelectorAll('#attention-grid th.key')].map(k => k.textContent)"
    )
    assert keys == src
    assert browser.js("document.querySelectorAll('#attention-grid img').length") == 0
    assert browser.js("document.body.hasAttribute('data-pwned')") is False
    # the picture beside the report loaded (relative path, allowed by the page's policy)
    assert browser.js("[...document.images].map(i => i.naturalWidth)") == [1]
    shot = browser.screenshot(tmp_path / "report_screenshot.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 1000
