// Open URL in headless Chromium, wait for window.result, print it as JSON (bench/web.py uses it).
//   node web/tools/page.mjs URL [TIMEOUT_SECONDS]
import {launch} from './browser.mjs';

const [url, timeout = '600'] = process.argv.slice(2);
const log = [];
const {page, close} = await launch({log: l => log.push(l)});
try {
  await page.goto(url);
  await page.waitForFunction(() => window.result !== undefined, null, {timeout: +timeout * 1000});
  const result = await page.evaluate(() => window.result);
  process.stdout.write(JSON.stringify({...result, log}));
} finally {
  await close();
}
