"""JUnit XML for CI: one testsuite per host, one testcase per check."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

from ernie_deploy.checks.result import CheckResult

# XML 1.0 forbids most C0 controls even escaped; journal lines can carry ANSI colour codes (ESC).
_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: str) -> str:
    return _ILLEGAL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)


def _body(r: CheckResult) -> str:
    parts = [r.summary, *r.evidence]
    if r.cause:
        parts.append(f"cause: {r.cause}")
    if r.fix:
        parts.append(f"fix: {r.fix}")
    return _clean("\n".join(parts))


def to_junit(results_by_host: Mapping[str, Sequence[CheckResult]], suite: str = "ernie-deploy verify") -> str:
    """Valid JUnit XML; a fail is a <failure>, a warn passes with its text in <system-out>."""
    root = ET.Element("testsuites", name=_clean(suite))
    total = failed = 0
    for host, results in results_by_host.items():
        fails = sum(r.status == "fail" for r in results)
        total, failed = total + len(results), failed + fails
        ts = ET.SubElement(root, "testsuite", name=_clean(host), tests=str(len(results)), failures=str(fails),
                           errors="0", skipped="0")
        for r in results:
            name = f"{r.instance}: {r.name}" if r.instance else r.name
            tc = ET.SubElement(ts, "testcase", name=_clean(name), classname=_clean(f"{suite}.{host}"))
            if r.status == "fail":
                failure = ET.SubElement(tc, "failure", message=_clean(r.summary), type="fail")
                failure.text = _body(r)
            elif r.status == "warn":
                ET.SubElement(tc, "system-out").text = "WARNING: " + _body(r)
            elif r.evidence:
                ET.SubElement(tc, "system-out").text = _body(r)
    root.set("tests", str(total))
    root.set("failures", str(failed))
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
