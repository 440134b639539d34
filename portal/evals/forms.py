"""Edge validation for the evaluation pages' forms (the services decide the rest)."""

from __future__ import annotations

from django import forms

from portal.evals.validation import MAX_CASES, MAX_FILE_BYTES


class EvaluationSetForm(forms.Form):
    file = forms.FileField(
        allow_empty_file=True,
        help_text=f'JSONL, one case a line: {{"prompt": "..."}} or {{"messages": [...]}}, with "expected" and '
        f'"check" (exact, contains, regex, json_valid, json_schema), optional "max_tokens" and "name". '
        f"At most {MAX_CASES} cases and {MAX_FILE_BYTES // 1024} KiB; a new upload replaces the set.",
    )


class GateForm(forms.Form):
    require_evaluation = forms.BooleanField(
        required=False, label="Require the evaluation to pass before a version gets traffic")
    evaluation_min_pass_rate = forms.IntegerField(
        required=False, min_value=0, max_value=100, label="Minimum pass rate (%)",
        help_text="Empty: at least the serving version's pass rate in the same run.")

    def min_pass_rate(self) -> float | None:
        percent = self.cleaned_data.get("evaluation_min_pass_rate")
        return None if percent is None else percent / 100
