"""The documentation cannot rot (issue 69): the site builds with `mkdocs build --strict` (a
broken link, a missing anchor or a page left out of the navigation fails), a real browser
renders its navigation and code blocks, the README stays short, every entry point says its
version, and every command the README and Getting started show is run here on the tiny
model, shortened by overrides (a command that needs a GPU is marked so on its page)."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES_WITH_COMMANDS = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")
GPU_MARK = "needs a GPU"
# Settings that shorten a launched run to seconds; a command's own values for these keys
# are replaced, the others kept.
SHORT = {
    "run.steps": "3",
    "run.groups_per_step": "2",
    "run.group_size": "2",
    "run.max_new_tokens": "8",
    "eval.every": "0",
    "run.checkpoint_every": "3",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason='the docs extra: pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def test_the_site_builds_strict_with_every_page_in_its_navigation(site):
    for page in ("index.html", "getting-started/index.html", "api/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    # the API reference is made from the docstrings
    assert "PrecisionPolicy" in api and "quantize_weights" in api and "register_correction" in api
    configuration = (site / "configuration" / "index.html").read_text()
    assert "run.steps" in configuration and "guard.far_tokens" in configuration


def browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.parametrize("page", ["index.html", "api/index.html"])
def test_a_browser_renders_the_navigation_and_the_code_blocks(site, page):
    """Headless Chromium runs the theme's scripts (they turn the page's `no-js` into
    `js`): the navigation is there, and the code (a command block on the home page, the
    documented signatures on the API page)."""
    chromium = browser()
    if chromium is None:
        if os.environ.get("ASYNCFP8_REQUIRE_BROWSER"):
            pytest.fail("chromium is not installed (CI installs Debian's chromium)")
        pytest.skip("no chromium here (apt-get install chromium)")
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            (site / page).as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for title in ("Getting started", "Choosing a precision", "Results", "API"):
        assert re.search(rf'class="md-nav__link[^"]*"[^>]*>\s*(<[^>]+>\s*)*{title}', dom), title
    html = re.search(r"<html[^>]*>", dom).group(0)
    assert "no-js" not in html and " js" in html, html  # the theme's script ran
    if page == "index.html":
        # the command block, highlighted, with the copy button the script adds
        assert re.search(r"<pre[^>]*>.*?md-code__button.*?<code>make<", dom, re.S)
    else:
        assert (
            'class="doc doc-heading"' in dom and "<code>asyncfp8.precision.PrecisionPolicy" in dom
        )


def test_the_readme_is_a_page_long():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "how"),
    [
        ("asyncfp8.launch", "hydra"),
        ("asyncfp8.learner", "hydra"),
        ("asyncfp8.worker", "hydra"),
        ("asyncfp8.plan", "hydra"),
        ("asyncfp8.demo", "hydra"),
        ("asyncfp8.report", "argparse"),
        ("asyncfp8.export", "argparse"),
    ],
)
def test_every_entry_point_says_the_version(module, how):
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"asyncfp8 {expected}", (how, done.stdout)


def shown_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of a bash block of the pages, continuation lines
    joined; blocks after a line that says they need a GPU are left out."""
    out = []
    for page in PAGES_WITH_COMMANDS:
        text = page.read_text()
        for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
            before = " ".join(text[: match.start()].rstrip().splitlines()[-2:])
            if GPU_MARK in before:  # the paragraph that leads into the block says so
                continue
            block = match.group(1).replace("\\\n", " ")
            for line in block.splitlines():
                command = line.split("  #")[0].strip()
                if command:
                    out.append((page.name, command))
    return out


def shortened(command: str, model_dir: Path, data: Path) -> str:
    """The command with the page's placeholders filled and a launched run made short (in
    runs/ of the directory it runs in)."""
    command = command.replace("/path/to/hf/model", str(model_dir))
    command = command.replace("task.path=train.jsonl", f"task.path={data}")
    if "asyncfp8.launch" not in command and not command.startswith("make run"):
        return command
    words = shlex.split(command)
    keys = {w.split("=", 1)[0] for w in words if "=" in w}
    words = [
        f"{w.split('=', 1)[0]}={SHORT[w.split('=', 1)[0]]}"
        if "=" in w and w.split("=", 1)[0] in SHORT
        else w
        for w in words
    ]
    extra = [f"{key}={value}" for key, value in SHORT.items() if key not in keys]
    if "model.path" not in keys:
        extra.append("model=tiny")
    extra.append("run.placement=colocated")
    if command.startswith("make run"):
        return f"make run ARGS={shlex.quote(' '.join(extra))}"
    if "run.dir" not in keys:
        extra.append(f"run.dir=runs/run{len(words)}")
    return shlex.join(words + extra)


@pytest.mark.slow
def test_every_command_the_readme_and_getting_started_show_runs(tmp_path, tiny_model_dir):
    """In the order the pages show them, each `python -m` command in a directory of its
    own page (its runs/ there), `make` and the setup script in the checkout; `make test` is
    what CI runs itself, so here its recipe is only checked to exist (`make -n`)."""
    data = ROOT / "asyncfp8" / "tasks" / "data" / "gsm8k_sample.jsonl"  # question, answer
    commands = shown_commands()
    assert any(c == "make run" for _, c in commands) and any(c == "make test" for _, c in commands)
    # `python` is this suite's (a user's activated venv)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "ASYNCFP8_VENV": str(ROOT / ".venv")}
    for page, command in commands:
        here = tmp_path / page.removesuffix(".md")
        here.mkdir(exist_ok=True)
        cwd = ROOT if command.startswith(("make", "bash scripts/")) else here
        if command == "make test":
            command = "make -n test"
        elif command.startswith("bash scripts/setup.sh"):
            env = {**env, "ASYNCFP8_VENV": str(tmp_path / "venv")}  # a fresh one
        else:
            command = shortened(command, tiny_model_dir, data)
            if command.startswith("make run"):
                command = command.replace("ARGS='", f"ARGS='run.dir={here / 'runs' / 'make'} ")
        done = subprocess.run(
            command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, (page, command, done.stdout[-2000:], done.stderr[-3000:])
        env["ASYNCFP8_VENV"] = str(ROOT / ".venv")
