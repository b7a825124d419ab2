"""The playground page in a real headless browser (Debian's chromium through selenium): `make test-browser`."""

from __future__ import annotations

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
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from test_playground import KEY, served  # noqa: E402,F401  (the server fixture)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
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

    method.select_by_value("")
    find(By.ID, "temperature").send_keys("0")
    find(By.ID, "message").send_keys("What is the capital of France?")
    find(By.ID, "send").click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token"))
    tokens = browser.find_elements(By.CSS_SELECTOR, "#transcript .assistant .token")
    assert "Paris" in "".join(t.text for t in tokens)
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
