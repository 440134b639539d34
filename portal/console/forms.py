"""Edge validation for the portal's forms; the services decide everything else and their
InvalidInput errors come back onto the form (add_service_error) as inline messages."""

from __future__ import annotations

from django import forms

from portal.core.exceptions import InvalidInput


def add_service_error(form: forms.Form, error: InvalidInput) -> None:
    """Show a service's InvalidInput on the field it names, or above the form."""
    field = error.field if error.field in form.fields else None
    form.add_error(field, error.message)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="A label for you, e.g. “staging server”.")
    expires_at = forms.DateTimeField(
        required=False, help_text="Optional, UTC, e.g. 2027-01-31 00:00.",
        widget=forms.DateTimeInput(attrs={"placeholder": "YYYY-MM-DD HH:MM"}),
    )
    allowed_models = forms.CharField(
        required=False, help_text="Optional: model ids this key may call, one per line (empty: any).",
        widget=forms.Textarea(attrs={"rows": 2}),
    )

    def clean_allowed_models(self) -> list[str] | None:
        lines = [line.strip() for line in self.cleaned_data["allowed_models"].splitlines()]
        models = [line for line in lines if line]
        return models or None


class AdapterCreateForm(forms.Form):
    name = forms.CharField(max_length=64, help_text="Lowercase letters, digits, dots, dashes or underscores; the model id becomes <tenant>/<name>.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    widget = MultipleFileInput

    def clean(self, data, initial=None):
        if not data:
            raise forms.ValidationError("Choose adapter_config.json and adapter_model.safetensors, or one .zip/.tar.gz.")
        files = data if isinstance(data, list | tuple) else [data]
        return [super(MultipleFileField, self).clean(item, initial) for item in files]


class UploadForm(forms.Form):
    # Empty files reach the service, which names them (an empty README.md is harmless, an empty
    # adapter file is not) exactly as the REST API does.
    files = MultipleFileField(
        allow_empty_file=True,
        help_text="The files PeftModel.save_pretrained wrote: adapter_config.json + adapter_model.safetensors "
        "(a README.md model card, tokenizer and other text files beside them are accepted and ignored), "
        "or one .zip / .tar.gz of that folder. Pickles (.bin, .pt) are refused.",
    )


class WeightsForm(forms.Form):
    """One integer field per ready version: weight_<number>."""

    def __init__(self, *args, versions=(), current: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        current = current or {}
        self.numbers = []
        for version in versions:
            self.numbers.append(version.number)
            self.fields[f"weight_{version.number}"] = forms.IntegerField(
                label=f"v{version.number}", min_value=0, max_value=1_000_000, required=False,
                initial=current.get(str(version.number), 0),
            )

    def weights(self) -> dict[int, int]:
        """{number: weight} with zero weights kept out; {} = the newest ready version."""
        result = {}
        for number in self.numbers:
            weight = self.cleaned_data.get(f"weight_{number}") or 0
            if weight:
                result[number] = weight
        return result


class CanaryGuardForm(forms.Form):
    """The canary guard's settings (their limits are checked by portal.rollouts.services)."""

    enabled = forms.BooleanField(required=False, label="Roll back a failing canary automatically")
    min_requests = forms.IntegerField(label="Minimum canary requests", help_text="Before the guard judges it.")
    error_rate_margin = forms.FloatField(label="Error rate margin",
                                         help_text="Absolute, over the serving version's: 0.05 = 5 points.")
    ttft_p95_factor = forms.FloatField(label="TTFT p95 factor", help_text="Times the serving version's p95.")

    def __init__(self, *args, guard=None, **kwargs):
        super().__init__(*args, **kwargs)
        if guard is not None and not self.is_bound:
            self.initial = {"enabled": guard.enabled, "min_requests": guard.min_requests,
                            "error_rate_margin": guard.error_rate_margin, "ttft_p95_factor": guard.ttft_p95_factor}
