"""The playground page in a real headless browser (Debian's chromium through selenium): `make test-browser`."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi", reason="decodekit serve needs decodekit[serve] (make test installs it)")
pytest.importorskip("selenium", reason="the browser test needs selenium and chromium: run `make test-browser`")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip(
        "the browser test needs chromium and chromedriver (Debian: apt install chromium chromium-driver): run "
        "`make test-browser`",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.expected_conditions import staleness_of  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from test_playground import KEY, served  # noqa: E402,F401  (the server fixture)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    driver.set_window_size(1400, 900)
    yield driver
    driver.quit()


def test_chat_tokens_alternatives_and_a_step_explained_in_the_page(browser, served):  # noqa: F811
    server, _ = served
    wait = WebDriverWait(browser, 240)
    find = browser.find_element
    browser.get(server.url + "/")
    find(By.ID, "api-key").send_keys(KEY, Keys.TAB)  # the page asks for the methods again with the key
    wait.until(lambda b: find(By.ID, "status").text == "ready")
    assert find(By.ID, "model").text == "smol"
    method = Select(find(By.ID, "method"))
    allowed = next(o.get_attribute("value") for o in method.options if o.text.endswith("(method)"))
    method.select_by_value(allowed)
    assert find(By.ID, "field-banned_token").get_attribute("placeholder") == "default: null"

    # What the server cannot serve is listed with the reason and cannot be chosen (beam search was offered, then 400).
    beams = next(o for o in method.options if o.get_attribute("value") == "beam_search")
    assert not beams.is_enabled() and "not served here" in beams.text

    method.select_by_value("")
    find(By.ID, "temperature").send_keys("0")
    find(By.ID, "message").send_keys("What is the capital of France?")
    find(By.ID, "send").click()
    # The reply streams: its tokens appear while the Send button still waits for the end.
    seen = []
    while not seen or find(By.ID, "send").get_attribute("disabled"):
        count = len(browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token"))
        if count:
            seen.append(count)
    final = len(browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token"))
    assert min(seen) < final, (seen[:5], final)  # not one whole reply at the end
    tokens = browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token")
    plain = browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token:not(.special)")
    special = browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token.special")
    assert "Paris" in "".join(t.text for t in plain) and "<|im_end|>" not in "".join(t.text for t in plain)
    # The end token is kept apart from the text, hidden until asked for (it read as part of the reply).
    assert [t.get_attribute("textContent") for t in special] == ["<|im_end|>"] and not special[0].is_displayed()
    find(By.ID, "show-special").click()
    assert special[0].is_displayed()
    find(By.ID, "show-special").click()
    tokens[0].click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#alternatives-table tr.alt")
    assert len(rows) == 5 and "chosen" in rows[0].get_attribute("class")

    method.select_by_value("processors")
    find(By.ID, "field-repetition_penalty").send_keys("1.5")
    find(By.ID, "message").send_keys("And of Italy?")
    find(By.ID, "explain").click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#explanation .chosen-token"))
    stages = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "#explanation .stage h3")]
    assert stages[0] == "the model's scores" and stages[-1] == "the final scores"
    assert any("RepetitionPenaltyLogitsProcessor" in s for s in stages[1:-1]), stages
    assert find(By.ID, "error").text == ""
    # The explanation panel shows whole at 1,400 px: nothing cut off to its right.
    panel = find(By.TAG_NAME, "section")
    assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth", panel)
    assert panel.rect["x"] + panel.rect["width"] <= 1400

    # A reply cut by max_tokens, then "Explain" with nothing typed: the reply's own next token, not a new turn's.
    from test_playground import MESSAGES, call

    longer = json.loads(
        call(server, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 4})[1]
    )
    find(By.ID, "reset").click()
    method.select_by_value("")
    find(By.ID, "max-tokens").clear()
    find(By.ID, "max-tokens").send_keys("3")
    find(By.ID, "message").send_keys(MESSAGES[0]["content"])
    find(By.ID, "send").click()
    wait.until(
        lambda b: (
            not find(By.ID, "send").get_attribute("disabled")
            and b.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token")
        )
    )
    reply = "".join(
        t.get_attribute("textContent") for t in browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token")
    )
    before = find(By.CSS_SELECTOR, "#explanation .chosen-token")  # the earlier explanation's, replaced by the new one
    find(By.ID, "explain").click()
    wait.until(staleness_of(before))
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#explanation .chosen-token"))
    chosen = json.loads(find(By.CSS_SELECTOR, "#explanation .chosen-token").text.removeprefix("chosen: "))
    assert reply + chosen == longer["choices"][0]["message"]["content"], (reply, chosen)


def test_two_methods_side_by_side_and_a_methods_facts_in_the_page(browser, served):  # noqa: F811
    server, allowed = served
    wait = WebDriverWait(browser, 240)
    find = browser.find_element
    browser.get(server.url + "/")
    find(By.ID, "api-key").send_keys(KEY, Keys.TAB)
    wait.until(lambda b: find(By.ID, "status").text == "ready")
    Select(find(By.ID, "method")).select_by_value(allowed)
    facts = find(By.ID, "facts").text
    assert "hooks: decodekit_config_fields, decodekit_logits_processors" in facts and "pin " in facts
    Select(find(By.ID, "method")).select_by_value("")
    find(By.ID, "temperature").send_keys("0")
    find(By.ID, "max-tokens").clear()
    find(By.ID, "max-tokens").send_keys("6")
    find(By.ID, "message").send_keys("What is the capital of France?")
    Select(find(By.ID, "compare-a")).select_by_value("")
    Select(find(By.ID, "compare-b")).select_by_value(allowed)
    find(By.ID, "compare").click()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#comparison .timing")) == 2)
    for side, name in (("a", "built-in generate"), ("b", allowed)):
        timing = find(By.CSS_SELECTOR, f"#compare-out-{side} .timing").text
        assert timing.startswith(f"{name}: ") and timing.endswith("ms/token"), timing
        assert browser.find_elements(By.CSS_SELECTOR, f"#compare-out-{side} .token")
    # With no banned token set, the method's tokens are the built-in's (greedy both).
    texts = [
        "".join(
            t.get_attribute("textContent") for t in browser.find_elements(By.CSS_SELECTOR, f"#compare-out-{s} .token")
        )
        for s in "ab"
    ]
    assert texts[0] == texts[1] and "Paris" in texts[0]


def test_searching_the_hub_and_a_results_facts_in_the_page(browser, served, hub, tmp_path):  # noqa: F811
    from methods import HOOK_METHOD, write_method

    server, _ = served
    readme = "---\ntags:\n- custom_generate\n---\nBans one token, as a hook.\n"
    sha = hub.repos.push_dir("acme/banner", write_method(tmp_path / "banner", HOOK_METHOD, readme=readme))
    wait = WebDriverWait(browser, 120)
    find = browser.find_element
    browser.get(server.url + "/")
    find(By.ID, "api-key").send_keys(KEY, Keys.TAB)
    wait.until(lambda b: find(By.ID, "status").text == "ready")
    find(By.ID, "search-query").send_keys("banner")
    find(By.ID, "search").click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#search-results .search-result"))
    result = find(By.CSS_SELECTOR, "#search-results .search-result")
    assert "acme/banner" in result.text and "Bans one token, as a hook." in result.text
    result.find_element(By.CSS_SELECTOR, "button.info").click()
    wait.until(lambda b: "pin " in find(By.CSS_SELECTOR, "#search-results .search-result").text)
    assert sha in find(By.CSS_SELECTOR, "#search-results .search-result").text
