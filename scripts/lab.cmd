@echo off
rem Windows: set up .venv (once, then offline) and open the course in JupyterLab on the learner notebooks.
rem   scripts\lab.cmd [--executed] [JUPYTER ARGS]   (as `bash scripts/lab.sh`; the work is done by course.py)
setlocal
cd /d "%~dp0.."
set "PY=python"
where py >nul 2>nul && set "PY=py -3"
%PY% scripts\course.py lab %*
exit /b %ERRORLEVEL%
