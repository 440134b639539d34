"""Celery tasks of the evals app: they take ids and call services (started by name, see
portal.core.jobs)."""

from celery import shared_task

from portal.evals.services import RUN_TASK, evaluation_run_execute


@shared_task(name=RUN_TASK, ignore_result=True, acks_late=True)
def evaluation_run_task(run_id: int) -> str | None:
    """Execute one evaluation run; returns its final status (None: nothing to do)."""
    run = evaluation_run_execute(run_id=run_id)
    return run.status if run is not None else None
