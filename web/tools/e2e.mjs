// The browser half of tests/test_web.py: drives the page in headless Chromium as a person would
// and writes what it saw to OUT/result.json (plus OUT/trainer.png and OUT/trained.onnx).
//   node web/tools/e2e.mjs URL OUT CASES.json
// CASES.json: {"epochs": 10, "fixed": {"steps": 10, "batchSize": 32, "lr": 0.01},
//              "bad": {"name": [paths]}, "custom": [paths] (trained, then stopped), "webgpu": true}
import fs from 'node:fs';
import path from 'node:path';
import {launch} from './browser.mjs';

const [url, out, casesPath] = process.argv.slice(2);
const cases = JSON.parse(fs.readFileSync(casesPath, 'utf8'));
const log = [];
const result = {log};
const settled = (states, timeout = 120000) => page => page.waitForFunction(
  s => s.includes(document.getElementById('message').dataset.state), states, {timeout});
const unsettle = page => page.evaluate(() => { document.getElementById('message').dataset.state = 'waiting'; });
const message = page => page.evaluate(() => {
  const m = document.getElementById('message');
  return {state: m.dataset.state, text: m.textContent};
});

async function drawZero(page) {
  const box = await page.locator('#pad').boundingBox();
  const cx = box.x + box.width / 2, cy = box.y + box.height / 2;
  await page.mouse.move(cx, cy - 90);
  await page.mouse.down();
  for (let i = 1; i <= 48; i++) {
    const a = (2 * Math.PI * i) / 48;
    await page.mouse.move(cx + 58 * Math.sin(a), cy - 90 * Math.cos(a));
  }
  await page.mouse.up();
  await page.waitForFunction(() => window.app.lastPrediction, null, {timeout: 30000});
  return page.evaluate(() => ({features: window.app.lastFeatures, ...window.app.lastPrediction,
                               shown: document.getElementById('prediction').textContent}));
}

async function main() {
  const {page, close} = await launch({log: l => log.push(l), acceptDownloads: true});
  try {
    const t0 = Date.now();
    await page.goto(url);
    await page.evaluate(() => window.app.loaded);
    result.loaded = {...await message(page), info: await page.evaluate(() => window.app.info), seconds: (Date.now() - t0) / 1000};
    const f = cases.fixed;
    result.fixed = await page.evaluate(c => window.app.fixedSteps(c.steps, c.batchSize, c.lr), f);

    await page.fill('#epochs', String(cases.epochs));
    await page.click('#train');
    await settled(['done', 'error'])(page);
    result.trained = {...await message(page), epochs: await page.evaluate(() => window.app.epochs),
                      history: await page.evaluate(() => window.app.history.train)};
    result.drawn = await drawZero(page);
    await page.screenshot({path: path.join(out, 'trainer.png')});
    const [download] = await Promise.all([page.waitForEvent('download'), page.click('#download')]);
    await download.saveAs(path.join(out, 'trained.onnx'));
    result.downloadName = download.suggestedFilename();

    result.bad = {};
    for (const [name, files] of Object.entries(cases.bad)) {
      await unsettle(page);
      await page.setInputFiles('#files', files);
      await settled(['error', 'ready'], 60000)(page);
      result.bad[name] = await message(page);
    }
    await unsettle(page);
    await page.setInputFiles('#files', cases.custom);
    await settled(['error', 'ready'], 60000)(page);
    result.custom = {...await message(page), info: await page.evaluate(() => window.app.info)};
    // a long run on the custom step: the page answers while the worker trains, and Stop stops it
    if (result.custom.state === 'ready') {
      await page.fill('#epochs', '1000');
      await page.click('#train');
      await page.waitForFunction(() => +document.getElementById('s-step').textContent >= 100, null, {timeout: 60000});
      const t0 = Date.now();
      await page.evaluate(() => new Promise(r => requestAnimationFrame(r)));
      const frameMs = Date.now() - t0;
      await page.click('#stop');
      await settled(['done', 'error'], 60000)(page);
      result.stopped = {...await message(page), frameMs, steps: +await page.textContent('#s-step')};
    }
  } finally {
    await close();
  }
  if (cases.webgpu) {
    const {page, close} = await launch({log: l => log.push(l), webgpu: true});
    try {
      await page.goto(url);
      await page.evaluate(() => window.app.loaded);
      await page.selectOption('#backend', 'webgpu');
      await settled(['ready', 'warn', 'error'])(page);
      result.webgpu = {...await message(page), info: await page.evaluate(() => window.app.info)};
      if (result.webgpu.info?.backend === 'webgpu') {
        result.webgpu.fixed = await page.evaluate(c => window.app.fixedSteps(c.steps, c.batchSize, c.lr), cases.fixed);
      }
    } finally {
      await close();
    }
  }
}

try {
  await main();
} catch (e) {
  result.error = String(e.stack || e);
}
fs.writeFileSync(path.join(out, 'result.json'), JSON.stringify(result));
