"""`keel report`: PNG plots of one or several runs and one self-contained HTML page."""

from keel.report.page import write_report
from keel.report.runs import ReportError, RunData, load_run

__all__ = ["ReportError", "RunData", "load_run", "write_report"]
