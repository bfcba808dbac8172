"""The dashboard's polling in a real browser (Debian's Chromium through npm
``playwright-core``, no browser download) against a live server: a value typed
into a schedule form survives the polls, a refused value and its error stay on
the page, a save says what it saved, and when the session ends the next poll
sends the whole tab to the sign-in page instead of swapping the sign-in form
into a section.

Screenshots of each step go to ``var/browser-artifacts/dashboard-polling`` in
the checkout (or ``KVCP_BROWSER_ARTIFACTS``), kept after the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django_celery_beat.models import PeriodicTask

from cacheadmin.models import AuditEvent, CacheNamespace, RetentionPolicy
from cacheadmin.schedules import schedules_sync
from tests.helpers import PROJECT

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
PASSWORD = "dash-browser-pass-1"
#: The whole script (Chromium's start, about 4 polls of 2 s and a 5 s wait) must end within this.
SCRIPT_TIMEOUT_S = 120

SCRIPT = r"""
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const BASE = process.env.BASE_URL;
const SHOTS = process.env.ARTIFACTS;
mkdirSync(SHOTS, { recursive: true });
const out = {};
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM, args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
let n = 0;
const shot = async (page, name) =>
  page.screenshot({ path: join(SHOTS, `${String(++n).padStart(2, '0')}-${name}.png`), fullPage: true });
/** Resolves once section #id has been swapped in anew (its data-updated-at moved). */
const swapped = (page, id) => page.locator(`#${id}`).getAttribute('data-updated-at').then((was) =>
  page.waitForFunction(([i, w]) => document.getElementById(i)?.dataset.updatedAt !== w, [id, was], { timeout: 30000 }));
try {
  const context = await browser.newContext();
  const page = await context.newPage();
  await page.goto(`${BASE}/login/`);
  await page.getByLabel('Username').fill(process.env.STAFF_USER);
  await page.getByLabel('Password').fill(process.env.PASSWORD);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.waitForURL(`${BASE}/`);
  const form = page.locator('#schedules tr[data-schedule="eviction-sweep"] form.schedule-form');
  const every = form.locator('input[name="every_s"]');

  // 1. Typed: two polls later both values are still there, the reason typed (no longer focused)
  //    in the eviction-runs section and the interval (focused) in the schedules section.
  const reason = page.locator('#eviction-plan-form').getByLabel('Reason');
  await reason.fill('typed while polling');
  await every.fill('1234');
  await swapped(page, 'cleanup');
  await swapped(page, 'cleanup');
  out.typed = await every.inputValue();
  out.reason = await reason.inputValue();
  out.skipped = await page.evaluate(() =>
    ['schedules', 'eviction-runs'].map((id) => 'swapSkippedAt' in document.getElementById(id).dataset));
  await shot(page, 'typed-survives-polls');

  // 2. Back to what was served and not focused: the section is swapped again.
  await every.fill('600');
  await every.evaluate((e) => e.blur());
  await swapped(page, 'schedules');
  out.swapped_when_idle = true;

  // 3. A refused value (the browser's own min check off, as a hand-made request would be).
  await every.fill('9');
  await form.evaluate((f) => { f.noValidate = true; });
  const [refused] = await Promise.all([page.waitForNavigation(), form.getByRole('button', { name: 'Save' }).click()]);
  out.refused_status = refused.status();
  await page.waitForTimeout(5000);
  out.refused_error = (await page.locator('#schedule-error').innerText()).trim();
  out.refused_value = await every.inputValue();
  await shot(page, 'refused-value-stays');

  // 4. A good value: back on the dashboard, which says what was saved.
  await every.fill('1200');
  await Promise.all([page.waitForURL(`${BASE}/#schedules`), form.getByRole('button', { name: 'Save' }).click()]);
  out.saved = (await page.locator('#messages').innerText()).trim();
  out.saved_every = (await page.locator('#schedules tr[data-schedule="eviction-sweep"] td.every').innerText()).trim();
  await shot(page, 'saved');

  // 5. Signed out (the session cookie gone): the next poll takes the tab to the sign-in page.
  await context.clearCookies();
  // Every polling section gets its own 401 + HX-Redirect, so the tab may start
  // the same navigation more than once (each aborting the last): wait on the
  // address, not on one navigation.
  for (let waited = 0; !/\/login\/\?next=/.test(page.url()); waited += 250) {
    if (waited > 30000) throw new Error(`still on ${page.url()} 30 s after signing out`);
    await page.waitForTimeout(250);
  }
  await page.waitForTimeout(1000);
  await page.waitForLoadState('load');
  out.signed_out_url = page.url().replace(BASE, '');
  out.title = await page.title();
  out.sections = await page.locator('.dash-section').count();
  await shot(page, 'signed-out');
} catch (error) {
  out.error = String(error.stack || error);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
"""


def artifacts() -> Path:
    """Where this test's screenshots go (emptied first)."""
    given = os.environ.get("KVCP_BROWSER_ARTIFACTS")
    folder = (Path(given) if given else Path(settings.BASE_DIR) / "var" / "browser-artifacts") / "dashboard-polling"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def test_polls_keep_typed_values_and_send_a_signed_out_tab_to_the_sign_in_page(world: dict, live_server: Any) -> None:
    # Debian's chromium comes with scripts/setup --test: its absence is a failure, not a skip.
    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: scripts/setup --test installs Debian's chromium"
    schedules_sync()
    for ns in CacheNamespace.objects.all():  # as namespace_get_or_create gives every namespace
        RetentionPolicy.objects.create(namespace=ns)
    User.objects.create_user("sam", password=PASSWORD, is_staff=True, is_superuser=True)
    folder = artifacts()
    env = {**os.environ, "BASE_URL": live_server.url, "ARTIFACTS": str(folder), "CHROMIUM": CHROMIUM,
           "STAFF_USER": "sam", "PASSWORD": PASSWORD}  # fmt: skip
    done = subprocess.run(
        ["node", "--input-type=module", "-e", SCRIPT],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"screenshots: {folder}")
    assert "error" not in seen, seen.get("error")
    assert seen == {
        "typed": "1234",
        "reason": "typed while polling",
        "skipped": [True, True],
        "swapped_when_idle": True,
        "refused_status": 400,
        "refused_error": "eviction-sweep: every_s must be between 10 and 604800 seconds, not 9. Nothing was changed.",
        "refused_value": "9",
        "saved": "Schedule eviction-sweep saved: every 1200 s, on.",
        "saved_every": "20 min",
        "signed_out_url": "/login/?next=/%23schedules",
        "title": "Sign in",
        "sections": 0,
    }
    task = PeriodicTask.objects.select_related("interval").get(name="eviction-sweep")
    assert (task.interval.every, task.enabled) == (1200, True)
    assert AuditEvent.objects.filter(action="schedule.update").count() == 1
    assert sorted(p.name for p in folder.glob("*.png")) == [
        "01-typed-survives-polls.png",
        "02-refused-value-stays.png",
        "03-saved.png",
        "04-signed-out.png",
    ]
