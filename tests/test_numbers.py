"""Every number with a unit of measure in the README, ``docs/`` and the notebooks' markdown comes from its source.

A measured number is typed only where this test checks it against the JSON it names in ``benchmarks/results/``
(a notebook prints its numbers from the JSON instead, as 09 draws its bars). The unit: µs, ms, GB/s, TB/s, %, or
a speed-up written ``6.26×`` (a shape's ``64 × 2048``, with spaces, is not one). Every block (lines between blank
lines: a paragraph, a table, a list item) holding such a number carries one marker, an HTML comment that renders
as nothing:

* ``<!-- source: h200_topk.json, h200_peers.json -->``: every such number of the block, and every decimal number in
  it, is a value of those files at the precision printed (a field; in ms where it is µs; a byte field at the run's
  copy rate, the floor; a percentage: a field, x 100, or a ratio of two fields of one row; a speed-up: a ratio of
  two fields of one row); targets written ``≤ 25 µs``, versions (``torch 2.11``) and code are not checked;
* ``<!-- record: 2026-12-05 ... -->``: a dated record of a same-process A/B whose runs are not committed (what lost,
  and why): it names its date and stays as it was measured;
* ``<!-- not measured: why -->``: a paper's or vendor's figure, a model's arithmetic, a limit or a target.
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
UNIT = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:-(\d[\d,]*(?:\.\d+)?))?(\s?(?:µs|ms|GB/s|TB/s|%)|×)(?![\w/])")
DECIMAL = re.compile(r"(?<![\w.,])([≤≥<>+]\s?)?(\d+\.\d+)(?![\w.])")
SLASHED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?=(?:\s?/\s?\d[\d,]*(?:\.\d+)?)+(\s?(?:µs|ms|GB/s|TB/s|%)|×))")
UNCHECKED = re.compile(r"\b(?:torch|triton|Python|CUDA|sglang-kernel|SGLang|DeepSeek-V|Llama-)\s?\d+(?:\.\d+)*"
                       r"|`[^`\n]*`")  # versions, and code
MARKER = re.compile(r"<!--\s*(source|record|not measured):\s*(.*?)\s*-->", re.S)


def documents() -> dict[str, str]:
    """``name -> text``: the README, every ``docs/*.md``, and each notebook's markdown cells (blank-line separated)."""
    out = {"README.md": (REPO / "README.md").read_text()}
    out.update({f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))})
    for p in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        out.update({f"notebooks/{p.name} c{i}": "".join(c["source"]) for i, c in enumerate(cells)
                    if c["cell_type"] == "markdown"})
    return out


def blocks(text: str) -> list[str]:
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


def leaves(value, out: list[float]) -> list[float]:
    if isinstance(value, bool):
        return out
    if isinstance(value, (int, float)) and math.isfinite(value):
        out.append(float(value))
    elif isinstance(value, dict):
        for v in value.values():
            leaves(v, out)
    elif isinstance(value, list):
        for v in value:
            leaves(v, out)
    return out


def keyed(value, prefix="", out=None) -> dict[str, float]:
    """A row's numeric fields by path (``parts_us.scores``)."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            keyed(v, f"{prefix}{k}.", out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix.rstrip(".")] = float(value)
    return out


_CANDIDATES: dict[str, dict[str, list[float]]] = {}


def candidates(name: str) -> dict[str, list[float]]:
    """The numbers a JSON stands for, by kind: ``raw`` its values (and in ms or s where they are µs or ms), ``ratio``
    the ratios of two fields of one row (and its speed-up fields), ``percent`` its values, values x 100, and a row's
    ratios as a percentage or as a percentage more or less."""
    if name not in _CANDIDATES:
        data = json.loads((RESULTS / name).read_text())
        values = leaves(data, [])
        ratios = [a / b for row in data.get("rows", []) for a, b in itertools.permutations(keyed(row).values(), 2)
                  if b]
        copy = data.get("copy_bandwidth_tbps")
        floors = [keyed(r)[f] / copy / 1e6 for r in data.get("rows", []) if copy for f in keyed(r) if "bytes" in f]
        raw = set(values) | {v / 1000 for v in values} | {v * 1000 for v in values} | set(floors)  # (floors: µs)
        percent = set(values) | {v * 100 for v in values} | {r * 100 for r in ratios} | \
            {abs(r - 1) * 100 for r in ratios}
        _CANDIDATES[name] = {"raw": sorted(raw), "ratio": sorted(set(ratios) | set(values)),
                             "percent": sorted(percent)}
    return _CANDIDATES[name]


def kind_of(unit: str) -> str:
    return {"×": "ratio", "%": "percent"}.get(unit.strip(), "raw")


def matches(printed: str, pool: list[float]) -> bool:
    value = float(printed.replace(",", ""))
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    i = bisect.bisect_left(pool, value - tolerance)
    return i < len(pool) and pool[i] <= value + tolerance


def problems(name: str, text: str) -> list[str]:
    """What is wrong with one document: blocks with a unit number and no marker; tied numbers not in their JSON."""
    found = []
    for block in blocks(text):
        prose = UNCHECKED.sub("", MARKER.sub("", block))
        measured = [(n, m.group(3)) for m in UNIT.finditer(prose) for n in m.group(1, 2) if n]  # (a range: both)
        measured += [m.group(1, 2) for m in SLASHED.finditer(prose)]  # "92.1 / 94.5 %": the unit of the last
        markers = MARKER.findall(block)
        if not measured and not any(kind == "source" for kind, _ in markers):
            continue
        where = f"{name}: {prose.strip()[:90]!r}"
        if not markers:
            found.append(f"{where}: {[n for n, _ in measured][:4]} with no marker (source, record or not measured)")
            continue
        sources = [s.strip() for kind, names in markers if kind == "source" for s in names.split(",")]
        if not sources:
            kinds = {kind for kind, _ in markers}
            if "record" in kinds and not re.search(r"\d{4}-\d{2}-\d{2}", " ".join(w for _, w in markers)):
                found.append(f"{where}: a record names its date")
            continue
        missing = [s for s in sources if not (RESULTS / s).is_file()]
        if missing:
            found.append(f"{where}: no {missing} in benchmarks/results/")
            continue
        pools = {k: sorted(set().union(*(candidates(s)[k] for s in sources))) for k in ("raw", "ratio", "percent")}
        targets = {m.group(1) for m in re.finditer(r"[≤≥<>]\s?(\d[\d,]*(?:\.\d+)?)", prose)}
        checked = {(n, kind_of(unit)) for n, unit in measured} | \
            {(m.group(2), "raw") for m in DECIMAL.finditer(prose) if not (m.group(1) or "").strip()}
        checked = {(n, k) for n, k in checked if n not in targets}
        unit_kinds = {n for n, k in checked if k != "raw"}  # (a decimal printed with × or % is checked as such)
        wrong = sorted(n for n, k in checked if not (k == "raw" and n in unit_kinds) and not matches(n, pools[k]))
        if wrong:
            found.append(f"{where}: {wrong} not in {sources}")
    return found


def test_every_number_with_a_unit_names_its_source():
    found = [p for name, text in documents().items() for p in problems(name, text)]
    assert not found, f"{len(found)} blocks:\n" + "\n".join(found)


def test_a_planted_stale_number_fails():
    """The test of the test: a number its JSON no longer says, beside the JSON's marker, is caught; so is a number
    with no marker, and a record without its date."""
    tied = "<!-- source: h200_sweep.json -->\n| 64 × 4K | 27.6 | 15.1 µs |"
    assert problems("planted", tied) == []
    assert problems("planted", tied.replace("15.1 µs", "15.7 µs"))  # the stale quote the review found
    assert problems("planted", "<!-- source: h200_engine.json -->\nthe step runs 6.18× faster") == []
    assert problems("planted", "<!-- source: h200_engine.json -->\nthe step runs 9.1× faster")
    assert problems("planted", "about 6.3× faster")  # no marker
    assert problems("planted", "<!-- record: 2026-12-05, same process -->\n+3 µs") == []
    assert problems("planted", "<!-- record: same process -->\n+3 µs")
