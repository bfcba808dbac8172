// The operators' browser flow (run by tests/browser/test_operator_flows.py).
//
// Drives Debian's Chromium through playwright-core against a running control
// plane. Each step records what the page showed into `seen.json` and takes a
// full-page screenshot `NN-<step>.png` in $ARTIFACTS. On any failure (a
// selector that does not appear within its wait, an unexpected status) it
// still writes what it saw so far, the error, and a screenshot of the failing
// page (`NN-<step>-FAILED.png`), then exits 1.
//
// Environment: BASE_URL, ARTIFACTS, STAFF_USER, READER_USER, USER_PASSWORD,
// ENGINE_ID, ENGINE_NAME, REFERENCE_ID, REFERENCE_NAME, NAMESPACE_ID,
// RELEASE_ID, ENGINE_READY_TIMEOUT_S (the engine's start, up to minutes),
// CHROMIUM (default /usr/bin/chromium).

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const env = (name, fallback) => {
  const value = process.env[name] ?? fallback;
  if (value === undefined) throw new Error(`flows.mjs: environment variable ${name} is required`);
  return value;
};
const BASE = env('BASE_URL').replace(/\/$/, '');
const ARTIFACTS = env('ARTIFACTS');
const STAFF = env('STAFF_USER');
const READER = env('READER_USER');
const PASSWORD = env('USER_PASSWORD');
const ENGINE_ID = env('ENGINE_ID');
const ENGINE_NAME = env('ENGINE_NAME');
const REFERENCE_ID = env('REFERENCE_ID');
const REFERENCE_NAME = env('REFERENCE_NAME');
const NAMESPACE_ID = env('NAMESPACE_ID');
const RELEASE_ID = env('RELEASE_ID');
/** One wait for a selector or a text (ms); the engine's start and the jobs get longer ones. */
const WAIT_MS = 30_000;
const ENGINE_WAIT_MS = Number(env('ENGINE_READY_TIMEOUT_S', '300')) * 1000;
const JOB_WAIT_MS = 180_000;
const MARKER = `kvcp-${Date.now()}`;

mkdirSync(ARTIFACTS, { recursive: true });
const seen = { base_url: BASE, started_at: new Date().toISOString(), steps: [], error: null };
const save = () => writeFileSync(join(ARTIFACTS, 'seen.json'), JSON.stringify(seen, null, 2));
const log = (...parts) => console.log(`${((Date.now() - t0) / 1000).toFixed(1)}s`, ...parts);
const t0 = Date.now();

class FlowError extends Error {}

/**
 * Run one step: `fn()` returns what it saw; then a full-page screenshot of
 * `page` is taken. On failure the failing page is screenshotted and the error
 * re-raised (the caller writes seen.json and exits 1).
 */
async function step(name, page, fn) {
  const number = String(seen.steps.length + 1).padStart(2, '0');
  log(`step ${number} ${name}`);
  let saw;
  try {
    saw = await fn();
  } catch (error) {
    const shot = `${number}-${name}-FAILED.png`;
    await page.screenshot({ path: join(ARTIFACTS, shot), fullPage: true }).catch(() => {});
    seen.failed_step = { name, screenshot: shot, url: page.url() };
    throw error;
  }
  const screenshot = `${number}-${name}.png`;
  await page.screenshot({ path: join(ARTIFACTS, screenshot), fullPage: true });
  seen.steps.push({ name, screenshot, url: page.url().replace(BASE, ''), saw });
  save();
  return saw;
}

/** Poll `read()` until `test(value)` holds; fail with `what` and the last value after `timeoutMs`. */
async function until(what, read, test, timeoutMs = WAIT_MS) {
  const deadline = Date.now() + timeoutMs;
  const values = [];
  let last;
  for (;;) {
    try {
      last = await read();
    } catch (error) {
      last = `(unreadable: ${error.message.split('\n')[0]})`;
    }
    if (values[values.length - 1] !== last) values.push(last);
    if (test(last)) return { value: last, values };
    if (Date.now() > deadline) {
      throw new FlowError(`timed out after ${timeoutMs / 1000} s waiting for ${what}; last seen: ${JSON.stringify(last)}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

/** The text of a locator that must be there within the wait (a clear message when it is not). */
async function textOf(locator, what, timeoutMs = WAIT_MS) {
  try {
    await locator.first().waitFor({ state: 'attached', timeout: timeoutMs });
  } catch {
    throw new FlowError(`missing on the page after ${timeoutMs / 1000} s: ${what}`);
  }
  return (await locator.first().innerText()).trim();
}

/** Cells of a table row, tab-joined the way innerText joins them (whitespace inside a cell collapsed). */
async function rowText(row) {
  const cells = await row.locator('td').allInnerTexts();
  return cells.map((c) => c.replace(/\s+/g, ' ').trim()).join('\t');
}

async function login(page, user) {
  await page.goto(`${BASE}/login/`);
  await page.getByLabel('Username').fill(user);
  await page.getByLabel('Password').fill(PASSWORD);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.waitForURL(`${BASE}/`);
  const who = await textOf(page.locator('header .who'), 'the signed-in user in the header');
  if (who !== user) throw new FlowError(`signed in as ${JSON.stringify(who)}, expected ${user}`);
  return who;
}

/** A new tab of `context` with the flow's default wait. */
async function newTab(context) {
  const page = await context.newPage();
  page.setDefaultTimeout(WAIT_MS);
  return page;
}

/** The dashboard's engines table (section `#engines`, see templates/cacheadmin/dashboard.html). */
function enginesTable(page) {
  return page.locator('#engines table').first();
}

/** The row of the engine named `name` in the dashboard's engines table. */
function engineRow(page, name) {
  return enginesTable(page).locator('tr', { has: page.getByRole('link', { name, exact: true }) });
}

/** Cells of the dashboard rows matching `selector`, each cell's whitespace collapsed. */
async function rowsCells(page, selector) {
  const out = [];
  for (const row of await page.locator(selector).all()) {
    out.push((await row.locator('td').allInnerTexts()).map((c) => c.replace(/\s+/g, ' ').trim()));
  }
  return out;
}

/** When `#id` on `page` was rendered (its data-updated-at, ms since the epoch), or 0. */
async function renderedAt(page, id) {
  const stamp = await page.locator(`#${id}`).first().getAttribute('data-updated-at');
  return stamp ? Date.parse(stamp) : 0;
}

/**
 * Wait on the watched dashboard until `selector`'s text is `want` and the
 * serving-now section was rendered after `since` (ms; each section polls on
 * its own); what the release and serving rows show then.
 */
async function dashboardShows(page, watch, selector, want, what, since = 0) {
  const { value, values } = await until(
    what,
    async () => (await page.locator(selector).first().innerText()).trim(),
    (text) => text === want,
    JOB_WAIT_MS,
  );
  await until('the serving-now section to render again', () => renderedAt(page, 'serving-now'), (t) => t > since, JOB_WAIT_MS);
  return {
    [selector]: value,
    texts_seen: values,
    release_rows: await rowsCells(page, `#releases tr[data-release-id="${RELEASE_ID}"]`),
    serving: await page.locator('#serving-now tr.serving-route[data-tenant="acme"]').evaluateAll((rows) =>
      rows.map((r) => [r.dataset.servedName, r.querySelector('td:nth-child(3)').innerText.trim(), r.dataset.percent])),
    ...(await watch.check()),
  };
}

/** The row of the dashboard's jobs section linking to `href` (a job's page). */
function rowLinking(page, href) {
  return page.locator(`#jobs tr:has(a[href="${href}"])`).first();
}

/** Job ids linked from the dashboard's jobs section under `prefix` ("/prewarm-jobs/"). */
async function linkedIds(page, prefix) {
  const hrefs = await page.locator(`#jobs a[href^="${prefix}"]`).evaluateAll((links) => links.map((a) => a.getAttribute('href')));
  return [...new Set(hrefs.map((h) => Number(h.split('/')[2])))];
}

/** A page that must not reload: a marker on `window` and a count of main-frame navigations. */
async function watchWithoutReload(page) {
  await page.evaluate((marker) => {
    window.__kvcpMarker = marker;
  }, MARKER);
  const watch = { navigations: 0 };
  page.on('framenavigated', (frame) => {
    if (frame === page.mainFrame()) watch.navigations += 1;
  });
  watch.check = async () => ({
    marker_survived: (await page.evaluate(() => window.__kvcpMarker ?? null)) === MARKER,
    navigations_since_marker: watch.navigations,
  });
  return watch;
}

/** POST a form body with the page's CSRF token, as a forged submission would; returns the HTTP status. */
async function forgedPost(page, path, fields) {
  return page.evaluate(
    async ({ path, fields }) => {
      const token = document.querySelector('input[name=csrfmiddlewaretoken]')?.value;
      if (!token) return -1;
      const body = new URLSearchParams({ csrfmiddlewaretoken: token, ...fields });
      const answer = await fetch(path, { method: 'POST', body, redirect: 'manual', credentials: 'same-origin' });
      return answer.status;
    },
    { path, fields },
  );
}

/** Names of the buttons inside `<main>` (the header's Sign out is not an action on the page). */
async function mainButtons(page) {
  return (await page.locator('main button, main input[type=submit]').allInnerTexts()).map((t) => t.trim());
}

/** The form on `page` that holds the button named `name`, or null. */
async function formWithButton(page, name) {
  const form = page.locator('main form', { has: page.getByRole('button', { name }) });
  return (await form.count()) > 0 ? form.first() : null;
}

/** Submit the engine page's form `formId` (filled by `fill`); the page goes to the new job's page. */
async function startJob(page, formId, buttonName, fill) {
  await page.goto(`${BASE}/engines/${ENGINE_ID}/`);
  const form = page.locator(`#${formId}`);
  await textOf(form.getByRole('button', { name: buttonName }), `the ${buttonName} button of #${formId} on the engine page`);
  await fill(form);
  await form.getByRole('button', { name: buttonName }).click();
  await page.waitForLoadState('load');
  const error = (await page.locator('main [role=alert], main .error').allInnerTexts()).join(' ').trim();
  if (error) throw new FlowError(`${buttonName} refused on the engine page: ${error}`);
  return { via: 'page', url: page.url().replace(BASE, '') };
}

/** Wait on the never-reloaded dashboard for a new job row under `prefix` and for its status to end. */
async function watchJob(dashboard, watch, prefix, before, status) {
  const { value: ids } = await until(
    `a new ${prefix} row on the dashboard`,
    () => linkedIds(dashboard, prefix),
    (now) => now.some((id) => !before.includes(id)),
    WAIT_MS,
  );
  const jobId = Math.max(...ids.filter((id) => !before.includes(id)));
  const row = rowLinking(dashboard, `${prefix}${jobId}/`);
  const { value, values } = await until(
    `job ${prefix}${jobId} to show ${status}`,
    () => rowText(row),
    (text) => text.split('\t').includes(status) || /\t(failed|cancelled)\t/.test(text),
    JOB_WAIT_MS,
  );
  if (!value.split('\t').includes(status)) throw new FlowError(`job ${prefix}${jobId} ended otherwise: ${value}`);
  return { job_id: jobId, row: value, row_texts_seen: values, ...(await watch.check()) };
}

async function main() {
  const browser = await chromium.launch({
    executablePath: env('CHROMIUM', '/usr/bin/chromium'),
    args: ['--no-sandbox', '--disable-dev-shm-usage'],
  });
  const viewport = { width: 1400, height: 1000 };
  const readerContext = await browser.newContext({ viewport });
  const staffContext = await browser.newContext({ viewport });
  try {
    // ---- Read-only operator: sees everything, can do nothing.
    const reader = await newTab(readerContext);
    await step('login-readonly', reader, async () => ({ who: await login(reader, READER) }));
    await step('dashboard-readonly', reader, async () => {
      await textOf(reader.getByRole('heading', { name: 'Engines' }), 'the Engines heading');
      writeFileSync(join(ARTIFACTS, 'readonly-dashboard.html'), await reader.content());
      return {
        headings: (await reader.locator('main h1').allInnerTexts()).map((t) => t.trim()),
        section_ids: await reader.locator('main [id]').evaluateAll((els) => els.map((e) => e.id)),
        buttons_in_main: await mainButtons(reader),
        post_forms_in_main: await reader.locator('main form[method=post]').count(),
      };
    });
    await step('readonly-refused', reader, async () => {
      const posts = {
        'plan eviction run': await forgedPost(reader, '/eviction-runs/plan', { reason: 'forged' }),
        [`start engine ${ENGINE_NAME}`]: await forgedPost(reader, `/engines/${ENGINE_ID}/start/`, {}),
        [`restart engine ${ENGINE_NAME}`]: await forgedPost(reader, `/engines/${ENGINE_ID}/restart/`, {}),
        [`decide release #${RELEASE_ID}`]: await forgedPost(reader, `/releases/${RELEASE_ID}/`, {
          action: 'decide', decision: 'verified_reuse', reason: 'forged',
        }),
        [`move traffic of release #${RELEASE_ID}`]: await forgedPost(reader, `/releases/${RELEASE_ID}/`, {
          action: 'traffic', percent: '10',
        }),
      };
      const saved = ['readonly-dashboard.html'];
      for (const [name, path] of [
        ['readonly-release.html', `/releases/${RELEASE_ID}/`],
        ['readonly-namespace.html', `/namespaces/${NAMESPACE_ID}/`],
        ['readonly-engine.html', `/engines/${ENGINE_ID}/`],
      ]) {
        await reader.goto(`${BASE}${path}`);
        writeFileSync(join(ARTIFACTS, name), await reader.content());
        saved.push(name);
      }
      // Last page loaded: the engine's, after the forged start and restart.
      return {
        posts,
        saved_html: saved,
        engine_status_after: await textOf(reader.locator('main h1 small'), 'the engine status in the heading'),
        buttons_on_engine_page: await mainButtons(reader),
      };
    });

    await readerContext.close();

    // ---- Staff: a dashboard that stays open, never reloaded, from here to the end.
    const dashboard = await newTab(staffContext);
    await step('login-staff', dashboard, async () => ({ who: await login(dashboard, STAFF) }));
    let watch;
    await step('dashboard-staff', dashboard, async () => {
      const row = await textOf(engineRow(dashboard, ENGINE_NAME), `engine ${ENGINE_NAME}'s row in the engines table`);
      watch = await watchWithoutReload(dashboard);
      return { engine_row: await rowText(engineRow(dashboard, ENGINE_NAME)), row_inner_text: row };
    });
    const initialEngineRow = seen.steps.at(-1).saw.engine_row;

    // Start the engine from its page (Start for a stopped engine; Restart before that button existed).
    const enginePage = await newTab(staffContext);
    await step('engine-start', enginePage, async () => {
      await enginePage.goto(`${BASE}/engines/${ENGINE_ID}/`);
      const before = await textOf(enginePage.locator('main h1 small'), 'the engine status in the heading');
      const start = enginePage.locator('main').getByRole('button', { name: 'Start', exact: true });
      const via = (await start.count()) > 0 ? 'Start' : 'Restart';
      await enginePage.locator('main').getByRole('button', { name: via, exact: true }).first().click();
      await enginePage.waitForLoadState('load');
      const after = await textOf(enginePage.locator('main h1 small'), 'the engine status in the heading');
      return { via, status_before: before, status_after: after };
    });
    // Its live fragment would poll every 2 s while the engine starts: two cores are better spent on the start.
    await enginePage.goto('about:blank');

    // While the engine starts: plan an eviction run from the dashboard (in another tab: the
    // watched one must not navigate) and approve it on its page.
    const evictionPage = await newTab(staffContext);
    let runId;
    const actionRows = async () => {
      const rows = evictionPage.locator('#run table tbody tr, main table tbody tr').filter({ has: evictionPage.locator('td') });
      const out = [];
      for (const row of await rows.all()) {
        out.push((await row.locator('td').allInnerTexts()).map((c) => c.replace(/\s+/g, ' ').trim()));
      }
      return out;
    };
    await step('eviction-planned', evictionPage, async () => {
      await evictionPage.goto(`${BASE}/`);
      const form = evictionPage.locator('#eviction-plan-form');
      await textOf(form.getByRole('button', { name: 'Plan a run (dry run)' }), 'the dashboard\'s #eviction-plan-form');
      await form.getByLabel('Reason').fill('browser flow: clear the orphan');
      await form.getByRole('button', { name: 'Plan a run (dry run)' }).click();
      await evictionPage.waitForURL(/\/eviction-runs\/\d+\/$/);
      runId = Number(evictionPage.url().split('/').at(-2));
      return {
        run_id: runId,
        status: await textOf(evictionPage.locator('main h1 small'), 'the run status in the heading'),
        actions: await actionRows(),
      };
    });
    await step('eviction-approved', evictionPage, async () => {
      const form = await formWithButton(evictionPage, 'Approve and run');
      if (form === null) throw new FlowError('missing on the run page: the "Approve and run" form');
      await form.getByLabel('Reason').fill('browser flow: approved');
      await form.getByRole('button', { name: 'Approve and run' }).click();
      await evictionPage.waitForURL(`${BASE}/eviction-runs/${runId}/`);
      return { status: await textOf(evictionPage.locator('main h1 small'), 'the run status in the heading') };
    });

    // The watched dashboard shows the engine ready, by itself.
    await step('dashboard-engine-ready', dashboard, async () => {
      const { value, values } = await until(
        `engine ${ENGINE_NAME} to show ready on the dashboard`,
        () => rowText(engineRow(dashboard, ENGINE_NAME)),
        (text) => /\tready · verified\t/.test(text) || /\tfailed/.test(text),
        ENGINE_WAIT_MS,
      );
      if (!/\tready · verified\t/.test(value)) throw new FlowError(`engine did not become ready: ${value}`);
      return { engine_row: value, row_texts_seen: [initialEngineRow, ...values.filter((v) => v !== initialEngineRow)], ...(await watch.check()) };
    });

    // The eviction run page polls by itself until the run ends.
    await step('eviction-succeeded', evictionPage, async () => {
      const { value } = await until(
        `eviction run #${runId} to end`,
        () => evictionPage.locator('main h1 small').first().innerText(),
        (s) => ['succeeded', 'failed', 'cancelled'].includes(s.trim()),
        JOB_WAIT_MS,
      );
      return { status: value.trim(), action_status: await actionRows() };
    });
    await evictionPage.close();
    await step('dashboard-eviction-succeeded', dashboard, () =>
      dashboardShows(dashboard, watch, `#eviction-runs tr[data-run-id="${runId}"] td.run-status`, 'succeeded',
        `eviction run #${runId} to show succeeded on the dashboard`),
    );

    // Prewarm from the engine page; the dashboard's prewarm row appears and finishes live.
    const prewarmBefore = await linkedIds(dashboard, '/prewarm-jobs/');
    await step('prewarm', enginePage, () =>
      startJob(enginePage, 'prewarm-form', 'Prewarm', async (form) => {
        await form.getByLabel('Corpus').fill('diagnostic');
      }),
    );
    await step('dashboard-prewarm-succeeded', dashboard, () =>
      watchJob(dashboard, watch, '/prewarm-jobs/', prewarmBefore, 'succeeded'),
    );

    // Compare against the reference engine, from the engine page.
    const compareBefore = await linkedIds(dashboard, '/comparison-jobs/');
    await step('compare', enginePage, () =>
      startJob(enginePage, 'compare-form', 'Compare', async (form) => {
        const reference = form.getByLabel('Reference');
        if ((await reference.locator(`option[value="${REFERENCE_ID}"]`).count()) === 0) {
          throw new FlowError(`the compare form offers no reference engine ${REFERENCE_NAME} (#${REFERENCE_ID})`);
        }
        await reference.selectOption(REFERENCE_ID);
        // Four output tokens are enough to compare; each saves decoding time on two cores.
        await form.getByLabel('Max tokens').fill('4');
      }),
    );
    const compared = await step('dashboard-compare-succeeded', dashboard, () =>
      watchJob(dashboard, watch, '/comparison-jobs/', compareBefore, 'succeeded'),
    );

    // The release: verified reuse with that comparison as evidence, 10 % of traffic on it, then a rollback.
    const releasePage = await newTab(staffContext);
    let actedAt = 0; // when the last decision's answer came back (ms)
    const releaseSaw = async () => ({
      status: await textOf(releasePage.locator('main h1 small'), 'the release status in the heading'),
      summary: await textOf(releasePage.locator('main h1 + p'), 'the release summary'),
      decision: await textOf(releasePage.locator('main h2:text-is("Decision") + p'), 'the decision paragraph'),
      buttons: await mainButtons(releasePage),
      timeline_kinds: (await releasePage.locator('main h2:text-is("Timeline") + table tbody tr td:nth-child(3)').allInnerTexts()).map((t) => t.trim()),
      error: (await releasePage.locator('main .error').allInnerTexts()).join(' '),
    });
    await step('release-decided', releasePage, async () => {
      await releasePage.goto(`${BASE}/releases/${RELEASE_ID}/`);
      const form = await formWithButton(releasePage, 'Decide');
      if (form === null) throw new FlowError('missing on the release page: the "Decide" form');
      await form.locator('select[name=decision]').selectOption('verified_reuse');
      await form.getByLabel('Reason').fill('same tokens, no deceptive hit');
      await form.getByLabel('Comparison job').fill(String(compared.job_id));
      await form.getByRole('button', { name: 'Decide' }).click();
      await releasePage.waitForLoadState('load');
      actedAt = Date.now();
      const saw = await releaseSaw();
      if (saw.error) throw new FlowError(`the decision was refused: ${saw.error}`);
      return saw;
    });
    const releaseStatus = `#releases tr[data-release-id="${RELEASE_ID}"] td.release-status`;
    await step('dashboard-release-decided', dashboard, () =>
      dashboardShows(dashboard, watch, releaseStatus, 'ready', `release #${RELEASE_ID} to show ready on the dashboard`, actedAt),
    );
    // Gray release: 10 % of acme's conversations on the new version, from the release page.
    await step('release-gray', releasePage, async () => {
      const form = releasePage.locator('#traffic-form');
      await textOf(form.getByRole('button', { name: 'Set traffic' }), 'the "Set traffic" form on the release page');
      const field = form.locator('input[name=percent]');
      const before = await field.inputValue();
      await field.fill('10');
      await form.getByRole('button', { name: 'Set traffic' }).click();
      await releasePage.waitForLoadState('load');
      actedAt = Date.now();
      const saw = await releaseSaw();
      if (saw.error) throw new FlowError(`moving traffic was refused: ${saw.error}`);
      // Locators resolve again on the page the form's answer loaded: the field as shown after the move.
      return { ...saw, percent_before: before, percent_after: await field.inputValue() };
    });
    // The watched dashboard shows the split by itself: the release row's share, then serving now rendered since.
    await step('dashboard-release-gray', dashboard, () =>
      dashboardShows(dashboard, watch, `#releases tr[data-release-id="${RELEASE_ID}"] td:nth-child(8)`, '10 %',
        `release #${RELEASE_ID} to show 10 % on the dashboard`, actedAt),
    );
    await step('release-rolled-back', releasePage, async () => {
      const form = await formWithButton(releasePage, 'Roll back');
      if (form === null) throw new FlowError('missing on the release page: the "Roll back" form');
      await form.getByLabel('Reason').fill('browser flow: roll back');
      await form.getByRole('button', { name: 'Roll back' }).click();
      await releasePage.waitForLoadState('load');
      actedAt = Date.now();
      const saw = await releaseSaw();
      if (saw.error) throw new FlowError(`the rollback was refused: ${saw.error}`);
      return saw;
    });
    await step('dashboard-release-rolled-back', dashboard, () =>
      dashboardShows(dashboard, watch, releaseStatus, 'rolled_back',
        `release #${RELEASE_ID} to show rolled_back on the dashboard`, actedAt),
    );
    seen.finished_at = new Date().toISOString();
    save();
    log('all steps passed');
  } finally {
    await browser.close();
  }
}

main().catch((error) => {
  const message = (error instanceof FlowError ? error.message : String(error.stack ?? error)).replace(/\u001b\[[0-9;]*m/g, '');
  const where = seen.failed_step ? `step ${seen.failed_step.name} at ${seen.failed_step.url}` : 'before the first step';
  seen.error = `${where}: ${message}`;
  save();
  console.error(`flows.mjs failed: ${seen.error}`);
  process.exit(1);
});
