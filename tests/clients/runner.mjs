// The runner the TypeScript client test scripts share (runner.py's twin): runs each test of
// `tests` in order, prints `ok   test_x` or `FAIL test_x` (with the error) for each and a final
// `N passed, M failed` line (tests/tests/*.rs check all three), and exits non-zero on a failure.
export async function run(tests) {
  let passed = 0, failed = 0;
  for (const [name, t] of Object.entries(tests)) {
    try {
      await t();
      passed++;
      console.log(`ok   test_${name}`);
    } catch (e) {
      failed++;
      console.log(`FAIL test_${name}\n${e.stack ?? e}`);
    }
  }
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}
