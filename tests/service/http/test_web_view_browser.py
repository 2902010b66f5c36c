"""The web view in a real browser (Playwright on Debian's Chromium): from the deployment list to
a deployment, a plan, the draft-vs-target diff and a runner's EPLB rebalances, with a screenshot
of each page under test-artifacts/web-view/ (printed; `pytest -s` shows the paths)."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
from web_tokens import READER_TOKEN, WORKER_TOKEN

CHROMIUM = os.environ.get("LOADPLAN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = pathlib.Path(__file__).resolve().parents[3] / "test-artifacts" / "web-view"

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed: `.venv/bin/pip install playwright` (`make test` installs it)")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (as root: `apt-get install -y chromium`; `make test` installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # Playwright's own browser download is not used: Debian's Chromium, no sandbox as root.
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(5000)
    yield pg
    context.close()


def shot(page, name: str) -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def first_cells(page) -> list[str]:
    return page.locator("#deployments td:first-child").all_inner_texts()


def test_list_to_deployment_to_plan_to_diff(page, history):
    page.goto(f"{history.base}/deployments")
    assert first_cells(page) == ["split-ep2", "qwen-one", "dsv3-ep2", "qwen-fuseep", "dsv3-observed"]  # newest first
    shot(page, "1-deployments")

    page.get_by_role("link", name="dsv3-ep2").click()
    page.wait_for_url("**/deployments/dsv3-ep2")
    assert page.locator(".runners[data-role=target] tr").count() == 3      # header + 2 ranks
    assert page.locator(".runners[data-role=speculative] tr").count() == 3
    assert page.locator(".agree").all_inner_texts() == ["ranks agree", "ranks agree"]
    assert "ep 1/2" in page.locator(".runners[data-role=target] tr").nth(2).inner_text()
    shot(page, "2-deployment")

    page.locator(".runners[data-role=target] .plan-link").first.click()
    page.wait_for_url(f"**/plans/{history.targets[0].plan_id}")
    decisions = page.locator("#decisions").inner_text()
    assert "moe.shared_experts_fusion" in decisions and "eplb.placement" in decisions
    assert "rebalanced after 2000 steps" in decisions                # the latest revision
    assert "runtime.a2a_backend" in page.locator("#inputs").inner_text()
    shot(page, "3-plan")

    page.locator("#eplb-link").click()
    page.wait_for_url("**/eplb")
    table = page.locator("#rebalances").inner_text()
    assert "rebalanced after 1000 steps" in table and "rebalanced after 2000 steps" in table
    assert page.locator("#rebalances td b").all_inner_texts() == ["0", "1", "2"]   # resolved, 2 rebalances
    shot(page, "4-eplb")

    page.go_back()
    page.go_back()
    page.locator(".draft-diff").first.click()                        # the draft vs its target, one click
    page.wait_for_url("**/diff?*")
    diff = page.locator("#diff-decisions").inner_text()
    assert "eplb.enabled" in diff and "moe.forward_path" not in diff      # the draft runs without EPLB
    inputs = page.locator("#diff-inputs").inner_text()
    assert "runtime.enable_eplb" in inputs and "role" in inputs
    assert history.targets[0].plan_id in page.locator("dl.a").inner_text()
    assert history.drafts[0].plan_id in page.locator("dl.b").inner_text()
    shot(page, "5-diff")


def test_filter_by_model_and_time(page, history):
    page.goto(f"{history.base}/deployments")
    page.fill("input[name=model]", "deepseek")
    page.click("button[type=submit]")
    page.wait_for_url("**model=deepseek*")
    assert first_cells(page) == ["split-ep2", "dsv3-ep2", "dsv3-observed"]
    page.goto(f"{history.base}/deployments?before=2000-01-01T00:00")
    assert "No deployment matches" in page.locator("main").inner_text()


def test_ranks_that_disagree_are_flagged(page, history):
    page.goto(f"{history.base}/deployments/split-ep2")
    assert page.locator(".agree").all_inner_texts() == ["ranks disagree on eplb.placement"]
    shot(page, "7-ranks-disagree")


def test_a_draft_plan_links_to_its_target(page, history):
    page.goto(f"{history.base}/plans/{history.drafts[1].plan_id}")
    page.locator("#diff-target").click()
    page.wait_for_url(f"**/diff?a={history.targets[1].plan_id}&b={history.drafts[1].plan_id}")
    assert "eplb.enabled" in page.locator("#diff-decisions").inner_text()


def test_unknown_plan_is_a_404_page(page, history):
    response = page.goto(f"{history.base}/plans/no-such-plan")
    assert response.status == 404 and "no-such-plan" in page.locator("main").inner_text()


def test_login_with_a_reader_token(page, guarded):
    base, plan = guarded.base, guarded.plan
    page.goto(f"{base}/plans/{plan.plan_id}")
    page.wait_for_url("**/login?*")
    page.fill("input[name=token]", WORKER_TOKEN)
    page.click("button[type=submit]")
    assert "not a reader's" in page.locator("main").inner_text()
    page.fill("input[name=token]", READER_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"**/plans/{plan.plan_id}")
    assert "moe.shared_experts_fusion" in page.locator("#decisions").inner_text()
    shot(page, "6-after-login")


def test_the_upgrade_check_page_names_what_a_release_changes(page, history):
    page.goto(f"{history.base}/upgrade")
    page.get_by_role("link", name="Upgrade check").wait_for()
    page.fill("input[name=to]", "0.5.23")
    page.fill("input[name=from]", "0.5.22")
    page.get_by_role("button", name="Check").click()
    page.wait_for_url("**/upgrade?*")
    rows = page.locator("#upgrade-deployments tr[data-status]")
    assert rows.count() == 1 and rows.first.get_attribute("data-status") == "changes"
    assert "clear" in page.locator("#upgrade-verdict").inner_text()
    change = page.locator(".upgrade-changes[data-deployment=qwen-fuseep] tr", has_text="moe.forward_path")
    assert "normal" in change.locator("td.a").inner_text() and "a2a" in change.locator("td.b").inner_text()
    shot(page, "6-upgrade-check")


def test_an_observed_plan_is_shown_as_observed_with_its_release(page, history):
    page.goto(f"{history.base}/deployments/dsv3-observed")
    cell = page.locator(".runners[data-role=target] tr", has_text="sglang 0.5.19 (observed)")
    assert cell.count() == 1 and cell.locator(".observed").count() == 1
    page.locator(".runners[data-role=target] .plan-link").first.click()
    page.wait_for_url("**/plans/*")
    assert "the release has no profile" in page.locator("main").inner_text()
    assert page.locator("#observed").count() == 1
    shot(page, "7-observed-plan")


def test_the_backends_page_shows_each_engines_own_table(page, history):
    page.goto(f"{history.base}/deployments")
    page.get_by_role("link", name="Backends").click()
    page.wait_for_url("**/backends")
    assert page.locator("#backends-of").inner_text().startswith("loadplan")
    page.select_option("select[name=engine]", "vllm")
    page.fill("input[name=version]", "0.31.0")
    page.get_by_role("button", name="Show").click()
    page.wait_for_url("**/backends?*")
    names = page.locator("#backends tr[data-backend]").evaluate_all("rows => rows.map(r => r.dataset.backend)")
    assert "passthrough" not in names and "deepep_low_latency" in names
    assert page.locator("#backends tr[data-backend=pplx]").get_attribute("data-accepted") == "no"
    page.goto(f"{history.base}/backends?engine=sglang")
    assert page.locator("#backends tr[data-backend=customized]").get_attribute("data-accepted") == "no"
    assert "sglang 0.5.23" in page.locator("#backends-of").inner_text()
    shot(page, "8-backends")
