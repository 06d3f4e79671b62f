"""`ndtrain report`: pages built from a real training run (pp=2, with its recorded pipeline
timeline), a real run without validation records, and real bench JSON results, opened in
headless Chromium: every plot must be a decoded image (naturalWidth > 0), counted in the DOM
Chromium dumps. The checker itself is shown to fail on a damaged image.

Chromium is Debian's package (`make test` installs it when missing and it can). Without it the
rendering tests fail, except for a non-root user, who cannot install it: they skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ndtrain.bench.harness import MB, BenchOptions, ContestResult, RunRecord
from ndtrain.cli.commands import main
from ndtrain.config import TrainConfig, load_config
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.run.timeline import read_timeline, timeline_step
from ndtrain.trainer import Trainer
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file, tiny_config

CURVES = {"loss", "throughput", "step_time", "memory", "comm", "lr", "grad_norm"}
VALIDATED = CURVES | {"val_accuracy"}  # a language-model run with validation records

# Appended to a copy of the page: at load (images loaded), list each <img> drawn whole: decoded, every pixel
# opaque and some ink (a PNG cut short decodes partly, leaving transparent rows). The report has no script of its own.
_CHECK = """<script>
function painted(image) {  // every pixel opaque (matplotlib's background) and some not white (the plot)
  const canvas = document.createElement("canvas");
  canvas.width = image.naturalWidth;
  canvas.height = image.naturalHeight;
  const context = canvas.getContext("2d");
  context.drawImage(image, 0, 0);
  const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
  let opaque = true, ink = 0;
  for (let k = 0; k < pixels.length; k += 4) {
    opaque = opaque && pixels[k + 3] === 255;
    ink += pixels[k] < 200 || pixels[k + 1] < 200 || pixels[k + 2] < 200;
  }
  return opaque && ink > 100;
}
window.addEventListener("load", () => {  // synchronous: done before Chromium dumps the DOM
  const images = [...document.images];
  const out = document.createElement("pre");
  out.id = "render-check";
  out.textContent = JSON.stringify({
    total: images.length,
    rendered: images.filter(i => i.complete && i.naturalWidth > 0 && painted(i)).map(i => i.dataset.plot),
  });
  document.body.appendChild(out);
});
</script>
"""


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.geteuid() != 0:
            pytest.skip("chromium is not installed and this user is not root, so cannot install it "
                        "(apt-get install chromium)")
        pytest.fail("chromium is not installed: `make test` installs it (apt-get install -y chromium)")
    return path


def rendered(page: Path, tmp_path: Path) -> tuple[int, list[str]]:
    """(number of <img>, data-plot names of those Chromium decoded) for the page."""
    checked = tmp_path / f"checked-{page.name}"
    checked.write_text(page.read_text(encoding="utf-8").replace("</body>", _CHECK + "</body>"), encoding="utf-8")
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--virtual-time-budget=10000",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    found = re.search(r'<pre id="render-check">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"no render check in Chromium's DOM (exit {proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return result["total"], result["rendered"]


class _Plots(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.names.append(a.get("data-plot") or "")
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("data:"):
                self.external.append(a[key])
        if tag in ("script", "link", "iframe"):
            self.external.append(tag)


def static_plots(html: str) -> list[str]:
    """The page's plot names; it must fetch nothing (no src/href but data URIs, no script, link or iframe)."""
    parser = _Plots()
    parser.feed(html)
    assert parser.external == []
    return parser.names


SMALL_RUN = {"schedule.steps": 3, "schedule.micro_batch": 2}  # four micro-batches of 2 per step


def _pp_worker(data: str, out: str) -> None:
    cfg = tiny_config(data, out, **{**SMALL_RUN, "parallel.pp": 2, "log.timeline": True})
    Trainer(cfg, init(cfg.parallel, init_method=init_method())).run()


def test_pipeline_run_report_renders_every_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "pp2"
    run_distributed(_pp_worker, 2, corpus_file(tmp_path), str(run_dir))
    header, ranks = read_timeline(run_dir / "timeline.json")
    assert (header["step"], header["pp"], header["schedule"]) == (2, 2, "1f1b")
    for events in ranks:  # 1f1b, 8 / 2 = 4 micro-batches: each forward and backward once per rank
        assert sorted(e.mb for e in events if e.kind == "F") == [0, 1, 2, 3]
        assert sorted(e.mb for e in events if e.kind == "B") == [0, 1, 2, 3]
        assert all(0 <= e.start <= e.end for e in events)
    assert 0 < header["bubble_fraction"] < 1

    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    page = run_dir / "report.html"
    assert capsys.readouterr().out == f"ndtrain: report written to {page}\n"
    html = page.read_text(encoding="utf-8")
    assert sorted(static_plots(html)) == sorted(VALIDATED | {"timeline"})
    assert "pipeline schedule 1f1b" in html and 'preset = &quot;tiny&quot;' in html  # layout and resolved config
    total, names = rendered(page, tmp_path)
    assert total == len(VALIDATED) + 1 and sorted(names) == sorted(VALIDATED | {"timeline"})

    damaged = tmp_path / "damaged.html"  # the check can fail: one image's PNG cut short is not decoded
    damaged.write_text(re.sub(r'(data-plot="loss"[^>]*base64,)([^"]{200})[^"]*"', r'\1\2"', html), encoding="utf-8")
    total, names = rendered(damaged, tmp_path)
    assert total == len(VALIDATED) + 1 and sorted(names) == sorted(VALIDATED - {"loss"} | {"timeline"})


def test_run_without_validation_records_renders(tmp_path: Path) -> None:
    cfg = tiny_config(corpus_file(tmp_path), str(tmp_path / "run"), **{**SMALL_RUN, "schedule.steps": 10, "checkpoint.exit_after": 2})
    Trainer(cfg, init(cfg.parallel)).run()  # stops after step 2: no evaluation yet
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and not any("val_loss" in r for r in records)
    (tmp_path / "run" / "timeline.json").write_text("{not json")  # unreadable: a note, not a failure
    out = tmp_path / "elsewhere" / "run.html"
    out.parent.mkdir()
    assert main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    assert sorted(static_plots(html)) == sorted(CURVES)
    assert "no validation records yet" in html and "is not a pipeline timeline written by ndtrain" in html
    assert "dp 1 × cp 1 × pp 1 × tp 1 on 1 process;" in html


def bench_result(scenario: str, names: list[str], reference: str) -> ContestResult:
    result = ContestResult(scenario, 2, reference, asdict(BenchOptions()), {"parameters": 1234})
    result.runs = {
        name: [RunRecord([0.01 * (k + 1) + 0.001 * i for i in range(3)], 1000.0 * (k + 1) if k == 0 else None,
                         2000.0 + r, [100 * MB + k, 110 * MB], [50 * MB, 50 * MB], [0, 0]) for r in range(3)]
        for k, name in enumerate(names)
    }
    return result


def test_bench_folder_report_renders(tmp_path: Path) -> None:
    folder = tmp_path / "bench-results"
    ddp = bench_result("ddp", ["ours", "torch", "limit"], "torch")
    ddp.write_json(folder / "ddp-n2.json")
    bench_result("pp", ["ours_1f1b", "torch_1f1b", "ours_gpipe"], "torch_1f1b").write_json(folder / "pp-n2.json")
    (folder / "plan-profile.json").write_text("{}")
    assert main(["report", str(folder)]) == 0
    html = (folder / "report.html").read_text(encoding="utf-8")
    expected = {"bench-ratio", "bench-peak", "bench-loopback", "bench-ddp-n2", "bench-pp-n2"}
    assert sorted(static_plots(html)) == sorted(expected)
    assert f"<td>{ddp.summary()['ours']['ratio']:.3f}</td>" == "<td>0.524</td>" and "<td>0.524</td>" in html
    assert "<td>0.355</td>" in html and "<td>11.00–11.00</td>" in html  # ours ÷ limit, ours' spread
    assert "ours_gpipe" in html and "torch_1f1b (reference)" in html
    assert "plan-profile.json: not an `ndtrain bench` result" in html
    total, names = rendered(folder / "report.html", tmp_path)
    assert total == len(expected) and sorted(names) == sorted(expected)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path.parent


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist: give a run directory"),
    ("file", "is not a directory: give a run directory"),
    ("empty", "holds neither metrics.jsonl nor `ndtrain bench` results"),
    ("other-json", "holds neither metrics.jsonl nor `ndtrain bench` results"),
    ("no-metrics", "has no metrics.jsonl: the run has not logged a step yet"),
    ("empty-metrics", "holds no records: the run has not logged a step yet"),
    ("corrupt-metrics", "line 2 is not a metrics record"),
])
def test_report_user_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                         message: str) -> None:
    target = {
        "missing": lambda: tmp_path / "nope",
        "file": lambda: _write(tmp_path / "f" / "x", "") / "x",
        "empty": lambda: (tmp_path / "e").mkdir() or tmp_path / "e",
        "other-json": lambda: _write(tmp_path / "o" / "a.json", '{"scenario": 1}'),
        "no-metrics": lambda: _write(tmp_path / "r" / "config.toml", "seed = 0\n"),
        "empty-metrics": lambda: _write(tmp_path / "r" / "metrics.jsonl", "\n"),
        "corrupt-metrics": lambda: _write(tmp_path / "r" / "metrics.jsonl", '{"step": 1, "loss": 5.0}\n{"step": 2, "lo'),
    }[case]()
    assert main(["report", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: report: ") and message in err
    assert not (target / "report.html").exists()


def test_timeline_config() -> None:
    def cfg(**overrides: object) -> TrainConfig:
        return load_config(None, {"schedule.steps": 3, **overrides})

    assert timeline_step(cfg()) is None
    assert timeline_step(cfg(**{"parallel.pp": 2, "log.timeline": True})) == 2
    assert timeline_step(cfg(**{"parallel.pp": 2, "log.timeline": True, "schedule.steps": 1})) == 1
    assert timeline_step(cfg(**{"parallel.pp": 2, "log.timeline": 3})) == 3
    with pytest.raises(UserError, match=r"log.timeline=true records a pipeline timeline: it needs parallel.pp > 1"):
        timeline_step(cfg(**{"log.timeline": True}))
    with pytest.raises(UserError, match=r"log.timeline=4 is after the run's last step 3"):
        timeline_step(cfg(**{"parallel.pp": 2, "log.timeline": 4}))
    for bad in (0, -1):
        with pytest.raises(UserError, match=r"log.timeline must be true, false or a step number >= 1"):
            cfg(**{"log.timeline": bad})
