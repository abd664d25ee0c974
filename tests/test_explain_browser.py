"""The HTML report in a real browser: headless Chromium, driven over the DevTools protocol
(tests/chromium.py). Without Chromium the test fails in one line that says so."""

from pathlib import Path

import pytest
import torch

from attnkit.explain import attention_sections, render_attention_html
from chromium import CHROMIUM, Browser

pytestmark = pytest.mark.needs("chromium")  # a missing browser fails in one line, everywhere

HOSTILE = "<img src=x onerror=\"document.body.setAttribute('data-pwned', '1')\">"
CLOSER = "</script><script>document.body.setAttribute('data-pwned', '2')</script>"


@pytest.fixture
def browser():
    b = Browser(CHROMIUM)
    try:
        yield b
    finally:
        b.close()


def weights(*shape: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1)


# The weights as drawn: each cell's colour read back from the canvas (white to blue by
# weight / max; the red channel is 255 - 208 * weight / max), at a corner clear of any number.
DRAWN = """(() => {
  const g = document.getElementById('attention-grid'), d = g.dataset, ctx = g.getContext('2d');
  const c = +d.cell, off = Math.min(1, c - 1), out = [];
  for (let i = 0; i < +d.rows; i++)
    for (let j = 0; j < +d.cols; j++) {
      const p = ctx.getImageData(+d.left + j * c + off, +d.top + i * c + off, 1, 1).data;
      out.push((255 - p[0]) / 208 * +d.max);
    }
  return out;
})()"""


def hover(browser: Browser, row: int, col: int) -> None:
    """A real mouse move (DevTools Input events) over cell (row, col) of the grid, scrolled
    into view first."""
    x, y = browser.js(
        f"""(() => {{
  const g = document.getElementById('attention-grid'), d = g.dataset, c = +d.cell;
  const wrap = g.closest('.grid-wrap');
  wrap.scrollTop = Math.max(0, +d.top + {row} * c - 100);
  wrap.scrollLeft = Math.max(0, +d.left + {col} * c - 100);
  wrap.scrollIntoView();
  const box = g.getBoundingClientRect();
  return [box.left + +d.left + ({col} + 0.5) * c, box.top + +d.top + ({row} + 0.5) * c];
}})()"""
    )
    event = {"type": "mouseMoved", "x": x, "y": y}
    browser.send("Input.dispatchMouseEvent", event, browser.session)


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
    atol = 0.003 * float(cross[0, 1, 1].max())  # a colour channel holds 1/208 of the largest
    torch.testing.assert_close(drawn, cross[0, 1, 1].double().reshape(-1), atol=atol, rtol=0)

    # choosing another head redraws the grid with that head's weights
    browser.js(
        "const s = document.getElementById('head-select'); s.value = '0';"
        "s.dispatchEvent(new Event('change')); true"
    )
    drawn0 = torch.tensor(browser.js(DRAWN), dtype=torch.float64)
    atol = 0.003 * float(cross[0, 1, 0].max())
    torch.testing.assert_close(drawn0, cross[0, 1, 0].double().reshape(-1), atol=atol, rtol=0)
    assert not torch.allclose(drawn0, drawn)
    assert browser.js("location.hash") == "#section=2&layer=1&head=0"

    # hovering a cell names its query and key and lists that query's weights, as text
    hover(browser, 2, 1)
    assert browser.js("document.querySelector('#row-details h2 .token').textContent") == "rains"
    assert (
        browser.js("document.querySelector('#row-details p.cell .token').textContent") == (src[1])
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
    hover(browser, 0, 0)
    keys = browser.js(
        "[...document.querySelectorAll('#row-weights td.key')].map(k => k.textContent)"
    )
    assert keys == src
    assert browser.js("document.querySelectorAll('#row-details img').length") == 0
    # the model view: every layer x head, and a click opens that one above
    assert browser.js("document.querySelectorAll('#model-grid canvas.thumb').length") == 2 * 3
    browser.js(
        'document.querySelector(\'#model-grid canvas.thumb[data-layer="1"][data-head="2"]\')'
        ".dispatchEvent(new MouseEvent('click', {bubbles: true})); true"
    )
    assert browser.js("location.hash") == "#section=0&layer=1&head=2"
    torch.testing.assert_close(
        torch.tensor(browser.js(DRAWN), dtype=torch.float64),
        enc[0, 1, 2].double().reshape(-1),
        atol=0.003 * float(enc[0, 1, 2].max()),
        rtol=0,
    )
    assert browser.js("document.body.hasAttribute('data-pwned')") is False
    # the picture beside the report loaded (relative path, allowed by the page's policy)
    assert browser.js("[...document.images].map(i => i.naturalWidth)") == [1]
    shot = browser.screenshot(tmp_path / "report_screenshot.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 1000


@pytest.mark.serial
def test_a_report_of_2048_tokens_opens_in_under_3_s_and_stays_responsive(tmp_path, browser):
    n, layers, heads = 2048, 6, 2
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(layers, heads, n, n, generator=g)
    w = scores / scores.sum(-1, keepdim=True)
    tokens = [f"t{i}" for i in range(n)]
    report = render_attention_html(
        [{"name": "self-attention", "query_tokens": tokens, "weights": w}], tmp_path / "long.html"
    )
    del scores
    browser.open(report.as_uri() + "#section=0&layer=5&head=mean")
    browser.wait_for("document.body.dataset.readyMs !== undefined", timeout=60)
    ready_ms = float(browser.js("document.body.dataset.readyMs"))
    assert ready_ms < 3000, f"the page took {ready_ms:.0f} ms to draw"
    assert browser.js("document.getElementById('attention-grid').dataset.rows") == "2048"
    # what is drawn is the mean of the heads of layer 5, to a byte's precision
    sample = browser.js(
        """(() => { const g = document.getElementById('attention-grid'), d = g.dataset;
        const p = g.getContext('2d').getImageData(+d.left + 7 * +d.cell, +d.top + 1000 * +d.cell,
          1, 1).data; return (255 - p[0]) / 208 * +d.max; })()"""
    )
    expected = float(w[5, :, 1000, 7].mean())
    assert abs(sample - expected) < 0.01 * float(
        browser.js("+document.getElementById('attention-grid').dataset.max")
    )
    # a hover answers within a frame or so, and a new layer draws within a second
    hover(browser, 1000, 7)
    took = browser.js(
        """(() => { const g = document.getElementById('attention-grid'), box =
          g.getBoundingClientRect(), d = g.dataset, t = performance.now();
          g.dispatchEvent(new MouseEvent('mousemove', {clientX: box.left + +d.left + 3,
            clientY: box.top + +d.top + 500 * +d.cell + 0.5, bubbles: true}));
          return performance.now() - t; })()"""
    )
    assert took < 100, f"a hover took {took:.0f} ms"
    assert browser.js("document.querySelector('#row-details h2 .token').textContent") == "t500"
    assert browser.js("document.querySelectorAll('#row-weights tr').length") == 20  # the largest
    took = browser.js(
        """(() => { const s = document.getElementById('layer-select'), t = performance.now();
          s.value = '2'; s.dispatchEvent(new Event('change')); return performance.now() - t; })()"""
    )
    assert took < 1000, f"drawing another layer took {took:.0f} ms"
    print(f"\n2,048 tokens x 6 layers: drawn {ready_ms:.0f} ms after the page was asked for; "
          f"another layer in {took:.0f} ms")  # fmt: skip
