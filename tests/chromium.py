"""A headless Chromium driven over the DevTools protocol, for the tests of the pages attnkit
writes (the HTML report) and serves (``attnkit serve``'s attention page).

It needs Chromium (Debian: ``apt-get install chromium``, which gives /usr/bin/chromium; or set
ATTNKIT_CHROMIUM to a Chromium/Chrome binary). No Python package is needed: the DevTools
protocol runs over a pair of pipes (``--remote-debugging-pipe``: the browser reads commands on
fd 3 and writes replies on fd 4, each a JSON message ending in NUL). The browser gets a fresh
profile directory and every network-related feature switched off.
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

CHROMIUM = (
    os.environ.get("ATTNKIT_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
)


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
        """Open ``url`` in a new tab and wait until it has loaded."""
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the page (not about:blank) has loaded
            try:
                if self.js("document.readyState === 'complete' && location.href !== 'about:blank'"):
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

    def type(self, text: str) -> None:
        """Type ``text`` into the focused element, as a keyboard would (input events)."""
        self.send("Input.insertText", {"text": text}, self.session)

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the middle of the element."""
        box = self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            event = {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            self.send("Input.dispatchMouseEvent", event, self.session)

    def wait_for(self, expression: str, timeout: float = 60) -> None:
        """Until the JavaScript ``expression`` is true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.js(expression):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{expression} stayed false for {timeout} s")

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
