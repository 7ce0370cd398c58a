"""The runner the client test scripts share: runs every `test_*` function of a module in name
order, prints `ok   test_x` or `FAIL test_x` (with the traceback) for each and a final
`N passed, M failed` line (tests/tests/*.rs check all three), and exits non-zero on a failure.
"""
import sys
import traceback


def run(namespace):
    tests = [(n, f) for n, f in sorted(namespace.items()) if n.startswith("test_") and callable(f)]
    passed = failed = 0
    for name, f in tests:
        try:
            f()
            passed += 1
            print(f"ok   {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
