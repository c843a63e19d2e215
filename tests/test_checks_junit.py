"""JUnit output parses, counts failures per host, escapes markup and strips XML-illegal characters."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ernie_deploy.checks.junit import to_junit
from ernie_deploy.checks.result import CheckResult, worst

RESULTS = {
    "gpu-a10-01": [
        CheckResult("tensor_parallel", "pass", "Using tensor parallel size 2 ✓", ("tensor_parallel_size=2",),
                    instance="vllm-ernie-0"),
        CheckResult("kv_cache", "warn", "GPU KV cache size 567,978 tokens, planner estimated 1,135,956",
                    instance="vllm-ernie-0"),
        CheckResult("startup_errors", "fail", "address_in_use: <OSError> & \x1b[31mboom\x1b[0m",
                    ("OSError: [Errno 98] Address already in use",), cause="port taken", fix="ss -ltnp"),
    ],
    "gpu-a100-01": [CheckResult("gpus_in_use", "fail", "GPU(s) [3] of the instance are idle")],
}


def test_junit_parses_and_counts() -> None:
    root = ET.fromstring(to_junit(RESULTS))
    assert root.tag == "testsuites" and root.get("tests") == "4" and root.get("failures") == "2"
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"gpu-a10-01", "gpu-a100-01"}
    a10 = suites["gpu-a10-01"]
    assert (a10.get("tests"), a10.get("failures")) == ("3", "1")
    cases = {c.get("name"): c for c in a10.iter("testcase")}
    assert set(cases) == {"vllm-ernie-0: tensor_parallel", "vllm-ernie-0: kv_cache", "startup_errors"}
    failure = cases["startup_errors"].find("failure")
    assert failure is not None
    assert failure.get("message") == "address_in_use: <OSError> & \\x1b[31mboom\\x1b[0m"
    assert "Address already in use" in (failure.text or "") and "fix: ss -ltnp" in (failure.text or "")
    warn = cases["vllm-ernie-0: kv_cache"]
    assert warn.find("failure") is None
    assert (warn.findtext("system-out") or "").startswith("WARNING: GPU KV cache size")


def test_empty_and_worst() -> None:
    root = ET.fromstring(to_junit({}))
    assert root.get("tests") == "0"
    assert worst(RESULTS["gpu-a10-01"]) == "fail"
    assert worst(RESULTS["gpu-a10-01"][:2]) == "warn"
    assert worst([]) == "pass"
    assert RESULTS["gpu-a100-01"][0].to_json()["status"] == "fail"
