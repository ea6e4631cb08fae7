"""Prefect flows: the DAGs. They only wire tasks; the work lives in the evaldag core."""
