"""eval/report.html in a real headless browser (Chromium from Debian; .ci/run installs it): the DOM after the
page's own script ran, with a real click on the Δ header."""

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from grpo.config import REPO_ROOT
from grpo.evaluate import report
from grpo.evaluate.evaluator import Scored
from grpo.evaluate.html_report import PAGE_SIZE, write_html
from grpo.layout import EvalDir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not CHROMIUM and not os.environ.get("REQUIRE_CHROMIUM"),
                                reason="chromium not installed (CI installs it and sets REQUIRE_CHROMIUM=1)")


class Dom(HTMLParser):
    """The elements of a page as (tag, attrs, text inside), in document order."""

    def __init__(self):
        super().__init__()
        self.elements, self.open = [], []

    def handle_starttag(self, tag, attrs):
        el = [tag, dict(attrs), ""]
        self.elements.append(el)
        if tag not in ("audio", "img", "input", "br", "meta"):
            self.open.append(el)

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for el in self.open:
            el[2] += data


def browse(page: Path, fragment: str, screenshot: Path | None = None) -> Dom:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
            "--virtual-time-budget=5000"]
    url = f"{page.as_uri()}#{fragment}"
    if screenshot:
        subprocess.run([*args, f"--screenshot={screenshot}", "--window-size=1400,1100", url], check=True,
                       capture_output=True, timeout=120)
    out = subprocess.run([*args, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120)
    dom = Dom()
    dom.feed(out.stdout)
    return dom


def build_report(out_dir: Path, n_items: int = 60) -> dict:
    import soundfile as sf

    rng = np.random.default_rng(0)
    reference = "今天天气很好"
    for name, better in (("base", 0.0), ("step_4", 0.15)):
        scored = []
        for i in range(n_items):
            for s in range(2):
                item = f"utt{i:03d}"
                wav = f"{name}/{item}.wav" if s == 0 else f"{name}/{item}_s{s}.wav"
                (out_dir / name).mkdir(parents=True, exist_ok=True)
                sf.write(out_dir / wav, 0.1 * np.sin(np.arange(1600) / 5.0), 16000)
                errors = int(rng.integers(0, 4)) if name == "base" else max(0, int(rng.integers(-1, 3)))
                hyp = reference[:6 - errors] + "汽" * errors                   # `errors` substitutions
                alt = reference[:5]                                              # one deletion
                scored.append(Scored(item, reference, hyp, errors / 6, 6, sample=s, wav=wav, sim=0.5 + better,
                                     judges={"sensevoice": (alt, 1 / 6)}))
        report.write_checkpoint(out_dir, name, scored, "CER", ["sensevoice"])
    summary = report.summarize(out_dir, ["base", "step_4"], "CER", "paraformer", reward_judge="sensevoice")
    report.write_summary(out_dir, summary)
    write_html(out_dir, summary, {n: report.read_tsv(EvalDir(out_dir).tsv(n)) for n in ("base", "step_4")},
               "paraformer")
    return summary


def test_synthetic_transcripts_are_marked_against_the_references_units():
    from grpo.evaluate.html_report import marked

    # 今天天气 -> jin1 tian1 tian1 qi4: one substitution (qi4 heard as qi1), the rest equal
    assert marked("今天天气", "jin1 tian1 tian1 qi1", "zh", units=True) == \
        'jin1 tian1 tian1 <span class="sub">qi1</span>'
    assert marked("今天天气", "今天天", "zh") == '今天天<span class="del">气</span>'


def test_report_html_in_chromium(tmp_path):
    summary = build_report(tmp_path)
    page = EvalDir(tmp_path).report_html
    shot = REPO_ROOT / "exp" / "report_html.png"
    shot.parent.mkdir(exist_ok=True)
    dom = browse(page, "click=delta", screenshot=shot)
    assert shot.stat().st_size > 10_000

    audio = [a["src"] for tag, a, _ in dom.elements if tag == "audio"]
    assert len(audio) == 2 * 60 and all((tmp_path / src).is_file() for src in audio)   # sample 0, per checkpoint

    tsv = {(r["id"], n): r for n in ("base", "step_4") for r in report.read_tsv(EvalDir(tmp_path).tsv(n))
           if r["sample"] == "0"}
    rows = [(a, t) for tag, a, t in dom.elements if tag == "tr" and "data-delta" in a]
    assert len(rows) == 60
    deltas = [float(a["data-delta"]) for a, _ in rows]
    assert deltas == sorted(deltas, reverse=True) and deltas[0] > 0 > deltas[-1]    # regressions first
    assert sum("hidden" not in a for a, _ in rows) == PAGE_SIZE                      # one page shown
    # transcripts and rates in the page are the TSV's; the summary table's figures are report.json's
    cells = [(a, t) for tag, a, t in dom.elements if tag == "td" and "data-checkpoint" in a]
    spans = [(a, t) for tag, a, t in dom.elements if tag == "span" and a.get("class") == "transcript"]
    rates = [t for tag, a, t in dom.elements if tag == "span" and a.get("class") == "rate"]
    order = [(a["data-id"], n) for a, _ in rows for n in ("base", "step_4")]
    assert [a["data-checkpoint"] for a, _ in cells] == [n for _, n in order]
    assert [a["data-text"] for a, _ in spans] == [x for k in order for x in (tsv[k]["transcript"],
                                                                            tsv[k]["transcript@sensevoice"])]
    assert rates == [f"{float(x):.3f}" for k in order for x in (tsv[k]["error_rate"], tsv[k]["error_rate@sensevoice"])]
    shown = {(a["data-checkpoint"], a["data-judge"]): t for tag, a, t in dom.elements
             if tag == "tr" and "data-judge" in a}
    for (name, judge), text in shown.items():
        assert f"{summary[name]['judges'][judge]['cer']:.4f}" in text
    assert len(shown) == 4
    assert ("flagged" in shown[("step_4", "paraformer")]) == summary["step_4"]["hacking_gap"]["paraformer"]["flagged"]
    # the differences are marked: every substituted character of a transcript in a "sub" span
    subs = [t for tag, a, t in dom.elements if tag == "span" and a.get("class") == "sub"]
    assert subs and all(set(t) == {"汽"} for t in subs)
    assert any(tag == "span" and a.get("class") == "del" for tag, a, _ in dom.elements)

    # the filter: regressions only
    only = browse(page, "click=delta&regressions=1")
    shown_rows = [a for tag, a, _ in only.elements if tag == "tr" and "data-delta" in a and "hidden" not in a]
    assert shown_rows and all(float(a["data-delta"]) > 0 for a in shown_rows)
    assert len(shown_rows) == min(PAGE_SIZE, sum(d > 0 for d in deltas))
