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
