"""`sexpgpu report`: an HTML page a real browser renders with no network, PNGs with
something drawn in them, `--watch` on a live run, and the run's own events as the
truth to compare with; markup in what a run says is shown as written, never run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sexpgpu_report.series import MOST_CHECKPOINT_MARKS, drawn_marks, read_events, series_of
from tests.e2e.helpers import run_sexpgpu, sexpgpu_in_process

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TRAIN_CHARTS = {"loss": 1, "lr": 1, "throughput": 1}
EVAL_CHARTS = {"eval-probe-loss": 1, "eval-probe-accuracy": 1}

# What the page shows, as the browser laid it out: per chart, its series and marks.
SURVEY = """() => [...document.querySelectorAll('figure')].map(f => ({
  id: f.id,
  declared: Number(f.dataset.series),
  series: [...f.querySelectorAll('g.series')].map(g => {
    const drawn = [...g.querySelectorAll('path, use')].map(e => e.getBoundingClientRect());
    return {
      marks: drawn.length,
      width: Math.max(0, ...drawn.map(b => b.width)),
      height: Math.max(0, ...drawn.map(b => b.height)),
    };
  }),
  marks: [...f.querySelectorAll('g.mark')].map(g => g.querySelector('title').textContent),
  box: f.querySelector('svg').getBoundingClientRect().width,
}))"""


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module: the system's, never a download."""
    from playwright import sync_api  # the dev extra installs it

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: run scripts/test-deps (the README's test command)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def resumed_report(gallery) -> Path:
    folder = gallery.folder("resumed")
    made = run_sexpgpu("report", folder, "--out", gallery.root / "rep", cwd=gallery.root)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(str(gallery.root / "rep" / "index.html"))
    return gallery.root / "rep"


@pytest.mark.slow  # the runs of the gallery: about 25 s on 2 cores
def test_a_resumed_run_renders_in_a_browser_as_one_curve_with_its_marks(
    gallery, resumed_report, browser
):
    run_events = list(read_events(gallery.folder("resumed") / "events.jsonl"))
    marks = [e for e in run_events if e["kind"] in ("annotation", "done")]
    kinds = [m.get("text", "done").split()[0] for m in marks]
    resume = kinds.index("resumed")
    assert resume > 0 and set(kinds[:resume]) == {"checkpoint"}  # by the run killed after
    status = json.loads((gallery.folder("resumed") / "status.json").read_text())
    expected = drawn_marks(series_of(run_events).marks, current=status.get("checkpoint")).marks
    drawn_checkpoints = sum(m.kind == "checkpoint" for m in expected)
    assert len(expected) == len(marks) or drawn_checkpoints == MOST_CHECKPOINT_MARKS
    requests: list[str] = []
    page = browser.new_page()
    page.on("request", lambda request: requests.append(request.url))
    page.goto((resumed_report / "index.html").as_uri())
    charts = {chart["id"].removeprefix("chart-"): chart for chart in page.evaluate(SURVEY)}
    page.close()
    # nothing fetched but the page itself: it is self-contained
    assert requests == [(resumed_report / "index.html").as_uri()]
    assert {k: len(c["series"]) for k, c in charts.items()} == {**TRAIN_CHARTS, **EVAL_CHARTS}
    for key, chart in charts.items():
        assert chart["declared"] == len(chart["series"]), key
        assert chart["box"] > 300, key
        for series in chart["series"]:
            assert series["marks"] >= 1 and series["width"] > 50, (key, series)
        # every annotation and `done` is a mark on every chart, its text on hover, but
        # for checkpoints past the most a chart draws (a killed run that went far
        # before its kill, on a loaded machine, wrote more)
        assert len(chart["marks"]) == len(expected), key
        assert [t.split(": ", 1)[1].split("\n")[0] for t in chart["marks"]] == [
            m.text.split("\n")[0] for m in expected
        ], key
    # a step reported twice (run again after the resume) is drawn once, as the run
    # that went on reported it
    drawn = series_of(run_events)
    latest = {e["step"]: e["value"] for e in run_events if e.get("name") == "loss"}
    assert drawn.curves["loss"] == sorted(latest.items())
    assert drawn.curves["loss"][-1][0] == gallery.resumed_steps


def test_one_curve_per_name_from_resumed_and_redelivered_events():
    def point(ident, step, value, time, name="loss"):
        return {"kind": "point", "id": ident, "step": step, "time": time, "name": name,
                "value": value}  # fmt: skip

    resumed = {"kind": "annotation", "id": "r", "step": 2, "time": 50.0, "text": "resumed from x"}
    tokens = [point(f"t{i}", s, 10 * s, t, "tokens") for i, (s, t) in enumerate(
        [(1, 0.0), (2, 1.0), (3, 2.0), (3, 51.0), (4, 52.0)])]  # fmt: skip
    drawn = series_of(
        [
            point("a", 1, 3.0, 0.0),
            point("b", 2, 2.0, 1.0),
            point("b", 2, 2.0, 1.0),  # the same event delivered twice
            point("c", 3, 1.5, 2.0),
            resumed,
            point("d", 3, 1.25, 51.0),  # step 3 again, after the resume
            point("e", 4, 1.0, 52.0),
            {**point("f", 4, 0.5, 53.0, "probe/loss"), "source": "evaluate"},
            {"kind": "point", "id": "g", "step": 5, "time": 1, "name": "loss"},  # no value
            *tokens,
        ]
    )
    assert drawn.curves["loss"] == [(1, 3.0), (2, 2.0), (3, 1.25), (4, 1.0)]
    assert drawn.evals == {"probe/loss": {"evaluate": [(4, 0.5)]}}
    assert [(m.step, m.kind) for m in drawn.marks] == [(2, "resumed")]
    # the rate never spans the resume's gap: 10 tokens a second on both sides
    assert drawn.throughput == ("tokens/s", [(2, 10.0), (3, 10.0), (4, 10.0)])


@pytest.mark.slow  # the runs of the gallery: about 25 s on 2 cores
def test_pngs_have_their_size_and_something_drawn(resumed_report):
    from PIL import Image

    names = sorted(p.stem for p in resumed_report.glob("*.png"))
    assert names == sorted({**TRAIN_CHARTS, **EVAL_CHARTS})
    for path in resumed_report.glob("*.png"):
        with Image.open(path) as image:
            assert image.size == (750, 300), path.name
            rgb = image.convert("RGB")
            colours = rgb.getcolors(maxcolors=1 << 16) or []
            white = sum(count for count, colour in colours if colour == (255, 255, 255))
            # a curve, marks and axes: many colours, a good share of the pixels not white
            assert len(colours) > 20, path.name
            assert white < 0.97 * 750 * 300, path.name
            # the blue of the first curve is there
            assert any(c[2] > 150 and c[0] < 80 for _, c in colours), path.name


@pytest.mark.slow  # the runs of the gallery: about 25 s on 2 cores
def test_report_of_runs_in_every_state_and_of_no_run(gallery):
    for what, shown in (("gone", "running (process gone)"), ("failed", "step 1: the proposed")):
        made = sexpgpu_in_process(
            "report", gallery.slugs[what], "--metrics-dir", gallery.metrics, cwd=gallery.root
        )
        assert made.returncode == 0, made.stderr
        page = (gallery.folder(what) / "report" / "index.html").read_text()
        assert shown in page and "http-equiv" not in page, what
    missing = sexpgpu_in_process(
        "report", "nope", "--metrics-dir", gallery.metrics, cwd=gallery.root
    )
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"sexpgpu report: E-REPORT-002: no run 'nope': neither a run folder nor a slug under "
        f"{gallery.metrics} (`sexpgpu runs` lists them)"
    ]


@pytest.mark.slow  # the runs of the gallery: about 25 s on 2 cores
def test_watch_refreshes_a_live_run_and_stops_on_a_signal_or_when_the_run_ends(gallery):
    watch = gallery.watch
    assert 'http-equiv="refresh"' in watch["live_page"]
    assert "running" in watch["live_page"]
    rc, out, err, page = watch["signalled"]
    assert rc == 143, err
    assert err.strip().splitlines()[-1] == (
        f"sexpgpu report: interrupted by SIGTERM; "
        f"{gallery.metrics / gallery.slugs['interrupted'] / 'report' / 'index.html'} is complete"
    )
    assert page.endswith("</html>\n")
    rc, out, err, page = watch["ended"]
    assert (rc, watch["run_rc"]) == (0, 143), err
    assert "http-equiv" not in page and "interrupted by SIGTERM at step" in page
    assert re.search(r'class="state-interrupted">interrupted<', page)
    left = sorted(p.name for p in (gallery.folder("interrupted") / "report").iterdir())
    assert not [name for name in left if name.endswith(".tmp")], left


def test_the_readme_test_command_installs_chromium_as_ci_does():
    repo = Path(__file__).parents[2]
    readme = (repo / "README.md").read_text()
    command = readme.split("## Run the tests", 1)[1].split("```bash\n", 1)[1].split("\n")[0]
    ci = (repo / ".ci" / "run").read_text()
    ci_command = ci.split("# --- the README's test command (keep in sync) ---\n")[1].split("\n")[0]
    for line in (command, ci_command):
        assert line.startswith("scripts/test-deps && "), line
        assert line.endswith("python -m pytest -n 2 -q"), line
    # here Chromium is there: the script installs nothing and says nothing
    done = subprocess.run([repo / "scripts" / "test-deps"], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


# Markup in what a run's events and status file say, each to be shown as written: a
# script that would leave its mark (a global, the title), the end of a chart's <svg>,
# an image that would be fetched, and & and both quotes.
def _nasty(where: str) -> str:
    return (
        f'<script>window.__ran = "{where}"; document.title = "ran"</script></svg>'
        f'<img src="http://127.0.0.1:9/{where}.png" onerror="window.__ran = \'{where}\'">'
        f" & \"double\" 'single' &amp; <b>{where}</b>"
    )


ESCAPES = """() => ({
  ran: window.__ran === undefined ? null : String(window.__ran),
  title: document.title,
  scripts: document.querySelectorAll('script').length,
  images: document.querySelectorAll('img').length,
  cells: Object.fromEntries([...document.querySelectorAll('tr')].filter(r => r.querySelector('th')
    && r.querySelector('td')).map(r => [r.querySelector('th').textContent,
    r.querySelector('td').textContent])),
  annotations: [...document.querySelectorAll('td pre')].map(p => p.textContent),
  captions: [...document.querySelectorAll('figcaption')].map(c => c.textContent),
  marks: [...document.querySelectorAll('figure')].map(f =>
    [...f.querySelectorAll('g.mark > title')].map(t => t.textContent)),
  svgText: [...document.querySelectorAll('svg text')].map(t => t.textContent),
})"""


def test_what_a_run_says_shows_as_written_and_runs_or_fetches_nothing(browser, tmp_path):
    folder = tmp_path / "m" / "esc-0a1b2c"
    folder.mkdir(parents=True)
    slug = "esc </title>" + _nasty("slug")
    run_file = "runs/" + _nasty("file") + ".sx"
    eval_name = _nasty("pass") + "/loss"  # one pass, one metric
    texts = [
        "checkpoint /ck/" + _nasty("checkpoint"),
        "a note\n" + _nasty("note"),
        "failed: step 3: " + _nasty("failed"),
    ]

    def event(kind: str, ident: str, step: int, **fields) -> dict:
        return {
            "kind": kind,
            "id": ident,
            "experiment": slug,
            "step": step,
            "time": 100.0 + step,
        } | fields

    events = [
        event("point", f"{name}@{step}", step, name=name, value=1.0 / step)
        for step in (1, 2, 3)
        for name in ("loss", eval_name)
    ]
    events += [event("annotation", f"a{step}", step, text=t) for step, t in enumerate(texts, 1)]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    error = "step 3: " + _nasty("error")
    status = {
        "state": "failed", "summary": f"failed: {error}", "error": error, "step": 2, "steps": 3,
        "checkpoint": "/ck/" + _nasty("status"), "slug": slug, "updated": 300.0,
        "run": "esc", "file": run_file,
    }  # fmt: skip
    (folder / "status.json").write_text(json.dumps(status))
    made = sexpgpu_in_process("report", folder, "--out", tmp_path / "rep", cwd=tmp_path)
    assert made.returncode == 0, made.stderr

    requests: list[str] = []
    url = (tmp_path / "rep" / "index.html").as_uri()

    def only_the_page(route):
        # recorded, and anything but the page refused: the test reaches out nowhere
        requests.append(route.request.url)
        if route.request.url == url:
            route.continue_()
        else:
            route.abort()

    page = browser.new_page()
    try:
        page.route("**/*", only_the_page)
        page.goto(url)
        page.wait_for_load_state("load")
        shown = page.evaluate(ESCAPES)
    finally:
        page.close()
    assert requests == [url]
    assert (shown["ran"], shown["scripts"], shown["images"]) == (None, 0, 0)
    assert shown["title"] == f"sexpgpu report: {slug}"
    cells = shown["cells"]
    assert cells["run file"] == run_file
    assert cells["error"] == error
    assert cells["last checkpoint"] == status["checkpoint"]
    assert eval_name in cells, list(cells)
    assert shown["annotations"] == texts
    assert f"eval {eval_name} \u00b7 eval-" in " ".join(shown["captions"])
    # every chart marks every annotation, its text on hover as written
    assert shown["marks"] and all(
        marks == [f"step {1 + i}: {text}" for i, text in enumerate(texts)]
        for marks in shown["marks"]
    )
    assert f"eval {eval_name}" in shown["svgText"]
