"""The step runners, one module per kind (exec_step, http_step, python_step and pycall, the python
step's child interpreter), and by_kind, the one place that picks a runner by kind. Importing the
package imports none of them: a python step's child interpreter imports only pycall."""
