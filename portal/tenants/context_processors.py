from django.http import HttpRequest

from portal.tenants.selectors import membership_list_for_user


def memberships(request: HttpRequest) -> dict:
    """The signed-in user's tenants, for the header's tenant switcher on every page (a lazy
    queryset: pages that do not render the header never query it)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"memberships": []}
    return {"memberships": membership_list_for_user(user=user)}
