"""/api/v1/ (mounted from portal/urls.py beside the adapters API): evaluation sets and runs."""

from rest_framework.routers import SimpleRouter

from portal.adapters.api.urls import TENANT
from portal.evals.api import views

ADAPTER = rf"{TENANT}/adapters/(?P<adapter_name>[^/]+)"

router = SimpleRouter()
router.register(rf"{ADAPTER}/evaluation-set", views.EvaluationSetViewSet, basename="evaluation-set")
router.register(rf"{ADAPTER}/versions/(?P<number>[0-9]{{1,9}})/evaluation-runs", views.EvaluationRunViewSet,
                basename="evaluation-run")

app_name = "evals-api"
urlpatterns = router.urls
