@echo off
rem Windows: set up .venv (once) and run the whole test suite, as `bash scripts/test.sh` does.
rem   scripts\test.cmd [--quick] [PYTEST ARGS]   (--quick: ruff and the unit tests only; the work is done by course.py)
setlocal
cd /d "%~dp0.."
set "PY=python"
where py >nul 2>nul && set "PY=py -3"
%PY% scripts\course.py test %*
exit /b %ERRORLEVEL%
