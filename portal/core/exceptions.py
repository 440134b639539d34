"""Domain exceptions shared by the apps' services; the API layer maps them to errors in one place."""

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models


class InvalidInput(ValueError):
    """A service was given a value it cannot accept; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def full_clean_or_raise(instance: models.Model) -> None:
    """Run the model's validators; report the first failure as InvalidInput naming the field."""
    try:
        instance.full_clean()
    except ValidationError as error:
        field, messages = next(iter(error.message_dict.items()))
        if field == NON_FIELD_ERRORS:
            field = instance._meta.model_name
        raise InvalidInput(field, " ".join(messages)) from None
