"""eval/report.html: one self-contained page (no server, no network) to read and listen to an evaluation.

The summary table (report.json's figures with their intervals, the judges, the hacking gaps) and report.png,
then one row per utterance: the reference text, the prompt audio, and per checkpoint an audio player (the
item's first sample), each judge's transcript with its differences from the reference marked (the Seed-TTS-eval
normalisation, aligned by jiwer), the item's error rate and SIM; the last column is the final checkpoint's
change in error rate vs base. Rows sort by any column header (the Δ one puts regressions first), a filter keeps
regressions only, and long sets paginate. Audio stays in files beside the page, referenced by relative paths.
"""

from __future__ import annotations

import html
from pathlib import Path

from grpo.evaluate import cer
from grpo.evaluate.stats import per_item_means
from grpo.layout import EvalDir

PAGE_SIZE = 50

STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:4px 6px;vertical-align:top}th.sortable{cursor:pointer;background:#eef}.sub{background:#fc9}.ins{background:#9cf}
.del{background:#f99;text-decoration:line-through}.worse{color:#b00;font-weight:bold}.better{color:#070}
audio{width:220px;height:32px}.judge{font-size:12px;color:#555}#pager button{margin:0 2px}"""

SCRIPT = """
const body = document.querySelector('#utterances tbody');
let rows = Array.from(body.rows), page = 0, dir = {};
const PAGE = %d;
function visible() { const only = document.getElementById('regressions').checked;
  return rows.filter(r => !only || parseFloat(r.dataset.delta) > 0); }
function show() { const v = visible(), pages = Math.max(1, Math.ceil(v.length / PAGE));
  page = Math.min(page, pages - 1); rows.forEach(r => r.hidden = true);
  v.forEach((r, i) => { r.hidden = !(i >= page * PAGE && i < (page + 1) * PAGE); body.appendChild(r); });
  const pager = document.getElementById('pager'); pager.innerHTML = '';
  for (let p = 0; p < pages; p++) { const b = document.createElement('button'); b.textContent = p + 1;
    b.disabled = p === page; b.onclick = () => { page = p; show(); }; pager.appendChild(b); } }
function sortBy(key) { dir[key] = -(dir[key] || 1);
  const val = r => { const x = parseFloat(r.dataset[key]); return isNaN(x) ? -Infinity : x; };
  rows.sort((a, b) => key === 'id' ? dir[key] * a.dataset.id.localeCompare(b.dataset.id)
                                   : dir[key] * (val(a) - val(b)) || a.dataset.id.localeCompare(b.dataset.id));
  page = 0; show(); }
document.querySelectorAll('th.sortable').forEach(th => th.onclick = () => sortBy(th.dataset.key));
document.getElementById('regressions').onchange = () => { page = 0; show(); };
const hash = new URLSearchParams(location.hash.slice(1));
if (hash.get('regressions') === '1') document.getElementById('regressions').checked = true;
if (hash.get('click')) document.querySelector(`th[data-key="${hash.get('click')}"]`).click(); else show();
"""


SYNTHETIC_JUDGES = ("synthetic", "synthetic_alt")    # they "hear" units (pinyin syllables, words), not text
SYNTHETIC_SPEAKER = "synthetic"     # eval.speaker_model: the synthetic reward's SIM (SyntheticVoices), no audio


def marked(reference: str, hypothesis: str, language: str, units: bool = False) -> str:
    """The hypothesis with substitutions, insertions and deletions against the reference marked (HTML); `units`:
    a synthetic judge's transcript, compared with the reference's units as its error rate is."""
    import jiwer

    if units:
        from grpo.speech.scoring import text_to_units

        ref, hyp, sep = " ".join(text_to_units(reference, language)), hypothesis, " "
    else:
        ref, hyp = cer.prepare(reference, language), cer.prepare(hypothesis, language)
        sep = "" if language == "zh" else " "
    if not ref.split() or not hyp.split():
        return html.escape(hypothesis) or "<i>(empty)</i>"
    out = jiwer.process_words(ref, hyp)
    r, h = out.references[0], out.hypotheses[0]
    parts = []
    for c in out.alignments[0]:
        if c.type == "equal":
            parts.append(html.escape(sep.join(h[c.hyp_start_idx:c.hyp_end_idx])))
        elif c.type == "delete":
            parts.append(f'<span class="del">{html.escape(sep.join(r[c.ref_start_idx:c.ref_end_idx]))}</span>')
        else:
            cls = "sub" if c.type == "substitute" else "ins"
            parts.append(f'<span class="{cls}">{html.escape(sep.join(h[c.hyp_start_idx:c.hyp_end_idx]))}</span>')
    return sep.join(parts)


def _fmt(x, digits=3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def summary_table(summary: dict) -> str:
    head = "<tr><th>checkpoint</th><th>judge</th><th>CER [95 % CI]</th><th>Δ vs base [95 % CI]</th><th>p</th>" \
           "<th>SIM [95 % CI]</th><th>hacking gap</th></tr>"
    body = []
    for name, r in summary.items():
        for j, e in r["judges"].items():
            gap = r.get("hacking_gap", {}).get(j)
            gap_s = "–" if gap is None else f"{gap['gap']:+.3f}" + (" <b>flagged</b>" if gap["flagged"] else "")
            delta = f"{e['delta']:+.3f}{_ci(e['delta_ci'])}" if "delta" in e else "–"
            sim = f"{r['sim']:.3f}{_ci(r.get('sim_ci'))}" if "sim" in r else "–"
            body.append(f'<tr data-checkpoint="{html.escape(name)}" data-judge="{html.escape(j)}">'
                        f"<td>{html.escape(name)}</td><td>{html.escape(j)}</td>"
                        f'<td class="cer">{e["cer"]:.4f}{_ci(e["cer_ci"])}</td><td>{delta}</td>'
                        f"<td>{_fmt(e.get('p_value'))}</td><td>{sim}</td><td>{gap_s}</td></tr>")
    return f"<table id=\"summary\">{head}{''.join(body)}</table>"


def write_html(out_dir: Path, summary: dict, tables: dict[str, list[dict]], primary: str, note: str = "") -> Path:
    """report.html from report.json's summary and the checkpoints' TSV rows."""
    names = list(tables)
    judges = [primary] + [c.split("@", 1)[1] for c in (tables[names[0]][0] if tables[names[0]] else {})
                          if c.startswith("error_rate@")]
    rate_col = {primary: "error_rate", **{j: f"error_rate@{j}" for j in judges[1:]}}
    text_col = {primary: "transcript", **{j: f"transcript@{j}" for j in judges[1:]}}
    first = {n: {r["id"]: r for r in rows if r["sample"] == "0"} for n, rows in tables.items()}
    rates = {n: per_item_means([{"id": r["id"], "v": float(r["error_rate"]) if r["error_rate"] else None}
                                for r in rows], "v") for n, rows in tables.items()}
    sims = {n: per_item_means([{"id": r["id"], "v": float(r["sim"]) if r.get("sim") else None} for r in rows], "v")
            for n, rows in tables.items()}
    final = names[-1]
    items = list(first[names[0]])
    head = ['<th class="sortable" data-key="id">item</th><th>reference</th><th>prompt</th>']
    head += [f'<th class="sortable" data-key="rate{k}">{html.escape(n)}</th>' for k, n in enumerate(names)]
    head.append(f'<th class="sortable" data-key="delta">Δ {html.escape(final)} vs base</th>')
    rows = []
    for item in items:
        ref = first[names[0]][item]
        language = ref.get("language") or "zh"
        delta = (rates[final].get(item) - rates["base"][item]) if "base" in rates and item in rates["base"] \
            and rates[final].get(item) is not None and final != "base" else None
        attrs = [f'data-id="{html.escape(item)}"', f'data-delta="{"nan" if delta is None else f"{delta:.6f}"}"']
        prompt = out_dir / "prompts" / f"{item}.wav"
        cells = [f"<td>{html.escape(item)}</td>", f'<td class="reference">{html.escape(ref["reference"])}</td>',
                 f'<td><audio controls preload="none" src="prompts/{html.escape(item)}.wav"></audio></td>'
                 if prompt.exists() else "<td>–</td>"]
        for k, n in enumerate(names):
            r = first[n].get(item)
            attrs.append(f'data-rate{k}="{"nan" if rates[n].get(item) is None else f"{rates[n][item]:.6f}"}"')
            if r is None:
                cells.append("<td>–</td>")
                continue
            audio = f'<audio controls preload="none" src="{html.escape(r["wav"])}"></audio><br>' if r.get("wav") else ""
            said = "".join(f'<div class="judge" data-judge="{html.escape(j)}">{html.escape(j)}: '
                           f'<span class="transcript" data-text="{html.escape(r.get(text_col[j], ""), quote=True)}">'
                           f'{marked(r["reference"], r.get(text_col[j], ""), language, j in SYNTHETIC_JUDGES)}</span> '
                           f'(<span class="rate">{_fmt(float(r[rate_col[j]]) if r.get(rate_col[j]) else None)}</span>)'
                           f"</div>" for j in judges)
            cells.append(f'<td data-checkpoint="{html.escape(n)}">{audio}{said}item rate '
                         f'<b class="item-rate">{_fmt(rates[n].get(item))}</b>, SIM {_fmt(sims[n].get(item))}</td>')
        cls = "" if delta is None else ' class="worse"' if delta > 0 else ' class="better"' if delta < 0 else ""
        cells.append(f"<td{cls}>{'–' if delta is None else f'{delta:+.3f}'}</td>")
        rows.append(f"<tr {' '.join(attrs)}>{''.join(cells)}</tr>")
    samples = next(iter(summary.values()))["samples"] if summary else 1
    page = (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Zero-shot evaluation</title>"
            f"<style>{STYLE}</style></head><body><h1>Zero-shot evaluation</h1>"
            f"<p>Figures: mean over items of each item's mean rate over {samples} sample(s), 95 % bootstrap interval "
            f"over items; Δ: paired bootstrap vs base. Hacking gap: improvement under the reward's judge minus "
            f"improvement under the held-out judge. {html.escape(note)}</p>{summary_table(summary)}"
            f'<p><img src="{EvalDir(out_dir).report_png.name}" alt="CER per checkpoint"></p><h2>Utterances</h2>'
            f'<label><input type="checkbox" id="regressions"> regressions only (Δ &gt; 0)</label>'
            f'<div id="pager"></div><table id="utterances"><thead><tr>{"".join(head)}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table><script>{SCRIPT % PAGE_SIZE}</script></body></html>')
    path = EvalDir(out_dir).report_html
    path.write_text(page, encoding="utf-8")
    return path
