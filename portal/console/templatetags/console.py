"""Display helpers for the console's templates."""

from django import template

register = template.Library()


@register.filter
def grouped(value):
    """12345678 -> "12,345,678"; floats rounded to whole numbers; None stays None-ish ("–")."""
    if value is None or value == "":
        return "–"
    try:
        return f"{round(float(value)):,}"
    except (TypeError, ValueError):
        return value
