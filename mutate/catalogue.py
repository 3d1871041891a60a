"""The mutants: plausible bugs a tired engineer would write, one snippet each.

Each `Mutant` names its target file (relative to the repository root), the exact original
snippet (it must occur exactly once there, or the mutant is stale), its replacement, the
bug in one line, and, for a mutant that cannot change behaviour, ``equivalent`` with the
reason. `SELECTIONS` maps each target to the tests that guard it (pytest arguments, run
in order with ``-x``: the fastest and most likely to fail first)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    target: str
    original: str
    replacement: str
    description: str
    equivalent: str | None = None


_FILES = {
    "MA": "statemachine/machine.py",
    "ST": "statemachine/state.py",
    "EN": "statemachine/envelope.py",
    "CO": "statemachine/codec.py",
    "SZ": "statemachine/sizes.py",
    "FL": "statemachine/fastload.py",
    "CT": "statemachine/controller.py",
    "JO": "statemachine/journal.py",
    "SS": "statemachine/stores.py",
    "SD": "statemachine/stored.py",
    "SQ": "statemachine/sqlite.py",
    "SE": "statemachine/sessions.py",
    "PG": "statemachine/postgres/steps.py",
    "PA": "statemachine/postgres/aio.py",
    "LP": "statemachine/runner/loop.py",
    "AT": "statemachine/runner/attempt.py",
    "PU": "statemachine/runner/publish.py",
    "RE": "statemachine/runner/remote.py",
    "AG": "statemachine/runner/agents.py",
    "OA": "statemachine/adapters/openai_agents.py",
    "AC": "statemachine/adapters/_calls.py",
    "MC": "statemachine/adapters/_mcp.py",
    "PD": "statemachine/adapters/pydantic_ai.py",
    "AN": "statemachine/adapters/anthropic.py",
    "LG": "statemachine/adapters/langgraph.py",
    "GA": "statemachine/adapters/google_adk.py",
    "IN": "statemachine/testing/invariants.py",
    "OP": "statemachine/operator.py",
    "VE": "statemachine/verifiers.py",
    "TE": "statemachine/telemetry.py",
}


def _m(ident: str, original: str, replacement: str, description: str,
       equivalent: str | None = None) -> Mutant:
    return Mutant(ident, _FILES[ident[:2]], original, replacement, description, equivalent)


_CORE = ("tests/core/test_controller.py", "tests/core/test_invariants.py",
         "tests/core/test_bad_input.py", "tests/core/test_payloads.py",
         "tests/core/test_partial_approval.py", "tests/core/test_codec.py",
         "tests/core/test_limits.py", "tests/core/test_machine.py",
         "tests/core/test_forged_logs.py", "tests/core/test_resolution.py",
         "tests/kit/test_corners.py")
_PD22_COMMENT = ("                    # (not isinstance(store, AsyncEventStore): a runtime "
                 "protocol checks\n                    # names only, and a sync store has the "
                 "same names)\n                    controller = await RunController.")
"""The lines between PD22's two changes (the sync-or-async dispatch and the buffering)."""
_WORLDS = "tests/kit/test_worlds.py"  # the slowest of a core selection: always last
_RUNNER = ("tests/runner/test_one_writer.py", "tests/runner/test_runner_promises.py",
           "tests/core/test_tool_interrupted.py", "tests/runner/test_streaming.py",
           "tests/runner/test_partial_approval.py", "tests/runner/test_crash_hooks.py",
           "tests/core/test_claim.py", "tests/storage/test_durability.py",
           "tests/runner/test_fencing.py", "tests/runner/test_verifiers.py",
           "tests/runner/test_riding.py", "tests/runner/test_new_input.py",
           "tests/runner/test_repeated_tail.py", "tests/storage/test_session_tail.py")
_CODEC = ("tests/core/test_codec.py", "tests/core/test_limits.py",
          "tests/core/test_keyed_chain.py", "tests/core/test_decoding.py",
          "tests/core/test_controller.py")
_POSTGRES = ("tests/storage/test_read_models.py", "tests/storage/test_leases.py",
             "tests/storage/test_nul.py",
             "tests/storage/test_dsn_secrets.py",
             "tests/storage/test_postgres_locks.py",
             "tests/storage/test_postgres_session.py",
             "tests/storage/test_postgres.py", "tests/storage/test_async_stores.py",
             "tests/runner/test_fencing.py::test_the_fence_on_postgresql_reads_the_run_head",
             "tests/storage/test_session_tail.py")
_STORES = ("tests/storage/test_read_models.py", "tests/storage/test_leases.py",
           "tests/storage/test_stores.py",
           "tests/storage/test_storage_faults.py",
           "tests/storage/test_async_stores.py", "tests/storage/test_snapshots.py",
           "tests/core/test_claim.py", "tests/runner/test_fencing.py",
           "tests/storage/test_session_tail.py")

_CONTROLLER = ("tests/core/test_copies.py", "tests/storage/test_leases.py", *_CORE,
               "tests/storage/test_read_models.py",
               "tests/storage/test_storage_faults.py",
               "tests/storage/test_snapshots.py", "tests/core/test_tool_interrupted.py",
               _WORLDS, "tests/storage/test_durability.py", "tests/runner/test_fencing.py",
               "tests/runner/test_riding.py", "tests/storage/test_session_tail.py")

_OPENAI_AGENTS_MCP = "tests/adapters/test_openai_agents_mcp.py"
_OPENAI_AGENTS = (*(f"tests/adapters/test_openai_agents.py::{test}" for test in (
    "test_row02_mcp_servers_are_carried_through_the_ledger",
    "test_row01_an_agent_tool_whose_agent_may_need_approval_is_refused_at_open",
    "test_row09_a_run_opened_on_another_session_is_refused_before_any_effect",
    "test_row03_a_call_a_tool_input_guardrail_rejects_never_runs_and_the_run_goes_on[run]",
    "test_row04_a_tripped_output_guardrail_never_accepts_the_output[run]",
    "test_row05_a_call_to_a_tool_the_agent_does_not_have[raise_error]",
    "test_row05_a_call_to_a_tool_the_agent_does_not_have[return_error_to_model]",
    "test_row07_a_decision_taken_on_the_sdk_state_is_honoured[same-state-approve]",
    "test_row07_a_decision_taken_on_the_sdk_state_is_honoured[saved-state-reject]",
    "test_row08_a_resent_result_is_the_text_the_sdk_sent_in_one_process",
    "test_row19_a_redacting_tool_output_guardrail_keeps_the_raw_output_out_of_the_store",
    "test_row10_a_handoff_is_carried_and_a_restart_goes_on_with_the_agent_handed_to",
    "test_row22_a_completed_run_answers_a_retried_request_from_its_ledger[run]",
    "test_row01_an_agent_used_as_a_tool_runs_whole_as_its_calls_body[run]",
    "test_row01_an_agent_tool_runs_on_the_callers_run_config",
    "test_row18_a_result_over_max_bytes_is_the_calls_failure_the_model_sees[over-the-log]",
    "test_row18_a_result_over_max_bytes_is_the_calls_failure_the_model_sees[over-its-batch]",
    "test_a_turn_resumed_without_its_sdk_state_replays_its_recorded_response",
    "test_a_replayed_turn_writes_none_of_its_items_twice[message]",
    "test_a_stream_whose_completed_response_is_empty_is_read_as_the_sdk_reads_it",
    "test_a_state_saved_at_an_earlier_turn_never_leads_the_sdk_back_into_it",
    "test_run_options_the_adapter_cannot_carry_are_refused_before_the_attempt"
    "[handoff_input_filter]",
    "test_run_options_the_adapter_cannot_carry_are_refused_before_the_attempt"
    "[pre_approval_guardrails]",
    "test_a_standing_decision_on_the_sdk_state_is_refused_naming_it[always_approve]",
    "test_a_tripped_guardrail_ends_the_run_naming_it[tool_input]",
    "test_a_tripped_guardrail_ends_the_run_naming_it[tool_output]",
    "test_a_tripped_guardrail_ends_the_run_naming_it[input]",
    "test_a_disabled_tool_is_unknown_to_the_ledger_as_to_the_sdk[False]",
    "test_a_disabled_tool_is_unknown_to_the_ledger_as_to_the_sdk[callable]",
    "test_a_superseded_attempt_runs_no_hook_guardrail_or_tool_after_the_model_call"
    "[final-buffered]",
    "test_a_superseded_attempt_runs_no_hook_guardrail_or_tool_after_the_model_call"
    "[tool-buffered]",
    "test_a_timed_out_tool_is_in_doubt_before_the_sdks_timeout_text_is_written",
    "test_an_attempt_left_writing_is_refused_naming_take_over_then_taken_over",
    "test_a_completed_call_is_resent_never_run_again",
    "test_hooks_and_guardrails_are_recorded_once",
    "test_arguments_other_than_the_approved_ones_never_run",
    "test_an_interrupted_tool_is_in_doubt_and_never_run_again[run]",
    "test_row18_a_call_the_run_has_no_room_for_is_refused_before_its_body",
    "test_differential[terminal-output-commit-then-raise-run]",
    "test_differential[approval-while-unsettled-partial-write-run_streamed]",
    "test_a_crash_while_the_model_answers_after_a_tool_leaves_the_call_completed",
)), "tests/adapters/test_extras.py")
"""The openai-agents adapter's guard: its differential rows and the tests that run in
one process, fastest first (the kill -9 rows and the whole matrix run in `just test`)."""

_SETTLED = ("tests/adapters/test_pydantic_ai_settled.py",
            "tests/adapters/test_anthropic_settled.py",
            "tests/adapters/test_openai_agents_settled.py")
"""A call settled from outside, and the adapters' own resolve_in_doubt / abandon."""

_VERIFIERS_OA = ("tests/adapters/test_openai_agents_verifiers.py::"
                 "test_tool_context_inside_sync_async_and_threaded_bodies",
                 "tests/adapters/test_openai_agents_verifiers.py::"
                 "test_a_verifier_it_cannot_use_is_refused_at_open",
                 "tests/adapters/test_openai_agents_verifiers.py::"
                 "test_a_verifier_of_a_tool_a_handoff_reaches_is_taken",
                 "tests/adapters/test_openai_agents_verifiers.py::"
                 "test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt"
                 "[after-return-True]")
_VERIFIERS_PD = ("tests/adapters/test_pydantic_ai_verifiers.py::"
                 "test_tool_context_inside_sync_async_and_threaded_bodies",
                 "tests/adapters/test_pydantic_ai_verifiers.py::"
                 "test_a_verifier_it_cannot_use_is_refused_at_open",
                 "tests/adapters/test_pydantic_ai_verifiers.py::"
                 "test_a_verifier_of_a_tool_of_a_toolset_is_taken",
                 "tests/adapters/test_pydantic_ai_verifiers.py::"
                 "test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt"
                 "[after-return-True]")
_VERIFIERS_AN = ("tests/adapters/test_anthropic_verifiers.py::"
                 "test_tool_context_inside_the_session_runners_bodies",
                 "tests/adapters/test_anthropic_verifiers.py::"
                 "test_tool_context_inside_the_messages_ledgers_bodies",
                 "tests/adapters/test_anthropic_verifiers.py::"
                 "test_the_messages_ledger_asks_its_verifier_at_open",
                 "tests/adapters/test_anthropic_verifiers.py::"
                 "test_an_async_verifier_needs_open_async",
                 "tests/adapters/test_anthropic_verifiers.py::"
                 "test_a_verifier_it_cannot_use_is_refused_at_open",
                 "tests/adapters/test_anthropic_verifiers.py::"
                 "test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt"
                 "[anthropic-session-c1-after-return-True]")
"""The adapters' tool_context() and verifiers, fastest first (the in-process tests and one
kill -9 row each; every row runs in `just test`): ahead of each adapter's long files, so a
mutant of this code is killed well within its time."""

_CORNERS = ("tests/adapters/test_openai_agents_corners.py",
            "tests/adapters/test_pydantic_ai_corners.py",
            "tests/adapters/test_anthropic_corners.py",
            "tests/adapters/test_anthropic_session_corners.py")
"""The adapter corners (issue 32): every mix of new, cached and in-doubt calls in a reply,
faults after a recorded result, older saved states, rival claims, lossy outputs."""

SELECTIONS: dict[str, tuple[str, ...]] = {
    "statemachine/machine.py": (*_CORE, _WORLDS),
    "statemachine/state.py": (*_CORE, "tests/storage/test_snapshots.py", _WORLDS),
    "statemachine/envelope.py": ("tests/core/test_envelope.py", *_CORE, _WORLDS),
    "statemachine/codec.py": _CODEC,
    "statemachine/sizes.py": _CODEC,
    "statemachine/fastload.py": (*_CODEC, "tests/storage/test_stores.py",
                                 "tests/core/test_bad_input.py", "tests/storage/test_nul.py"),
    "statemachine/controller.py": _CONTROLLER,
    "statemachine/journal.py": (*_CONTROLLER, "tests/storage/test_async_stores.py::"
                                "test_a_sync_stores_missing_run_is_not_found_without_a_"
                                "worker_thread"),
    "statemachine/stores.py": _STORES,
    "statemachine/stored.py": (*_STORES, "tests/core/test_codec.py::"
                               "test_a_stored_events_text_is_its_encoded_documents"),
    "statemachine/sqlite.py": ("tests/storage/test_sqlite_in_transaction.py",
                               "tests/storage/test_sessions.py", *_STORES,
                               "tests/storage/test_sqlite_shared_session.py",
                               "tests/storage/test_nul.py",
                               "tests/tools/test_cli_reads.py::"
                               "test_read_verbs_leave_a_live_writers_shm_as_it_was"),
    "statemachine/sessions.py": ("tests/storage/test_sessions.py",
                                 "tests/runner/test_partial_approval.py"),
    "statemachine/postgres/steps.py": (
        *_POSTGRES, "tests/storage/test_stores.py::test_an_appends_events_are_read_once"),
    # sync.py is generated from aio.py and not regenerated for a mutant: only the async
    # store and Session run one planted in aio.py
    "statemachine/postgres/aio.py": (*_POSTGRES,
                                     "tests/storage/test_postgres_group_commit.py",
                                     "tests/storage/test_group_commit.py"),
    "statemachine/runner/loop.py": _RUNNER,
    "statemachine/runner/attempt.py": (*_RUNNER, "tests/storage/test_leases.py"),
    "statemachine/runner/publish.py": (*_RUNNER, "tests/storage/test_leases.py",
                                       "tests/storage/test_sqlite_shared_session.py"),
    "statemachine/runner/remote.py": ("tests/runner/test_remote.py",
                                      "tests/runner/test_runner_promises.py"),
    "statemachine/runner/agents.py": _RUNNER,
    "statemachine/adapters/openai_agents.py": (*_VERIFIERS_OA, *_OPENAI_AGENTS,
                                               "tests/adapters/test_openai_agents_settled.py",
                                               "tests/adapters/test_openai_agents_corners.py",
                                               _OPENAI_AGENTS_MCP),
    "statemachine/adapters/_mcp.py": (_OPENAI_AGENTS_MCP,),
    "statemachine/adapters/_calls.py": ("tests/adapters/test_calls.py", *_VERIFIERS_OA,
                                        *_VERIFIERS_PD, *_VERIFIERS_AN, *_OPENAI_AGENTS,
                                        *_SETTLED, *_CORNERS,
                                        "tests/adapters/test_anthropic_resumed.py::test_a_"
                                        "posted_call_asked_for_again_with_other_arguments_"
                                        "is_refused"),
    "statemachine/adapters/pydantic_ai.py": (
        *_VERIFIERS_PD,
        "tests/adapters/test_pydantic_ai_durability.py::"
        "test_each_effect_finds_the_durable_record_that_allows_it",
        "tests/adapters/test_pydantic_ai.py", "tests/adapters/test_pydantic_ai_settled.py",
        "tests/adapters/test_pydantic_ai_corners.py"),
    "statemachine/adapters/anthropic.py": (*_VERIFIERS_AN, "tests/adapters/test_anthropic.py",
                                           "tests/adapters/test_anthropic_resumed.py",
                                           "tests/adapters/test_anthropic_settled.py",
                                           "tests/adapters/test_anthropic_corners.py",
                                           "tests/adapters/test_anthropic_session_corners.py",
                                           "tests/adapters/test_anthropic_history.py",
                                           "tests/adapters/test_anthropic_compaction.py"),
    # the durability files run each row in fresh processes (kill -9, two resumers): last
    "statemachine/adapters/langgraph.py": ("tests/adapters/test_langgraph_together.py",
                                           "tests/adapters/test_langgraph.py",
                                           "tests/adapters/test_langgraph_savers.py",
                                           "tests/adapters/test_langgraph_corners.py",
                                           "tests/adapters/test_langgraph_durability.py"),
    "statemachine/adapters/google_adk.py": ("tests/adapters/test_google_adk.py",
                                            "tests/adapters/test_google_adk_corners.py",
                                            "tests/adapters/test_google_adk_durability.py"),
    "statemachine/verifiers.py": ("tests/runner/test_verifiers.py",),
    "statemachine/operator.py": ("tests/storage/test_operator.py",
                                 "tests/tools/test_cli_operator.py"),
    "statemachine/testing/invariants.py": ("tests/core/test_resolution.py",
                                           "tests/core/test_invariants.py", _WORLDS),
    "statemachine/telemetry.py": ("tests/core/test_telemetry.py",
                                  "tests/adapters/test_telemetry_adapters.py"),
}

CATALOGUE: tuple[Mutant, ...] = (
    # ------------------------------------------------------------ machine: guards
    _m("MA01", "s.turns < s.max_turns", "s.turns <= s.max_turns",
       "turns_left off by one: one model call past max_turns"),
    _m("MA02", '"no_envelope", "turns_left", "results_published"),',
       '"no_envelope", "turns_left"),',
       "begin_model_call forgets results_published: the model is called with results "
       "unpublished"),
    _m("MA03", "return len(ids) == len(e.tool_calls) and s.calls.keys().isdisjoint(ids)",
       "return s.calls.keys().isdisjoint(ids)",
       "calls_are_new lets one response repeat a call id"),
    _m("MA04", "return len(ids) == len(e.tool_calls) and s.calls.keys().isdisjoint(ids)",
       "return len(ids) == len(e.tool_calls)",
       "calls_are_new lets a response reuse an id the run already knows"),
    _m("MA05", "return bool(e.tool_calls) and not any(c.needs_approval for c in e.tool_calls)",
       "return not any(c.needs_approval for c in e.tool_calls)",
       "calls_without_approval holds for a response without calls (output goes to TOOLS)"),
    _m("MA06", "return not e.tool_calls and e.output is not None",
       "return not e.tool_calls",
       "output_only accepts a response with neither calls nor output"),
    _m("MA07", "return record is not None and record.phase == Phase.COMPLETED",
       "return record is not None and record.phase in (Phase.COMPLETED, Phase.PUBLISHED)",
       "result_unpublished accepts an already posted result (posted twice)"),
    _m("MA08", "return record is not None and record.phase == Phase.AWAITING",
       "return record is not None and record.phase in (Phase.AWAITING, Phase.APPROVED)",
       "call_awaits_decision lets an approved call be decided again"),
    _m("MA09", "return record is None or bool(record.fingerprint == e.fingerprint)",
       "return True",
       "fingerprint_matches never compares: an approval binds to any arguments"),
    _m("MA10", "return s.count(Phase.APPROVED) > 0", "return s.count(Phase.APPROVED) >= 0",
       "approved_call_unstarted off by one: resume with nothing approved"),
    _m("MA11", "return phase is Phase.APPROVED or (phase is Phase.STARTED and "
               "record.call.idempotent)",
       "return phase is Phase.APPROVED or phase is Phase.STARTED",
       "call_can_start ignores the idempotent flag: a started call may start again (I11)"),
    _m("MA12", "return record is not None and record.phase == Phase.STARTED",
       "return record is not None and record.phase in (Phase.STARTED, Phase.APPROVED)",
       "call_started accepts a result for a call never started"),
    _m("MA13", "        return r.call_id is not None and r.call_id in s.calls\n",
       "        return r.call_id is not None\n",
       "guardrail_fits_stage accepts a tool guardrail for an unknown call"),
    _m("MA14", '"no_envelope", "guardrail_fits_stage", "guardrail_not_repeated"),',
       '"no_envelope", "guardrail_fits_stage"),',
       "guardrail_evaluated row drops guardrail_not_repeated: a guardrail runs twice (I1)"),
    _m("MA15", '"no_envelope", "hook_fits_scope", "hook_not_repeated"),',
       '"no_envelope", "hook_fits_scope"),',
       "hook_ran row drops hook_not_repeated: a hook runs twice (I1)"),
    _m("MA16", "return s.count(Phase.STARTED) == 0", "return s.count(Phase.STARTED) <= 1",
       "no_call_started off by one: one started call is tolerated"),
    _m("MA17", "return s.unpublished_results() == 0 and not s.pending_guardrails",
       "return s.unpublished_results() == 0",
       "nothing_unpublished forgets guardrails: complete drops pending guardrail results"),
    _m("MA18", "return s.unpublished_results() == len(e.call_ids)",
       "return s.unpublished_results() >= len(e.call_ids)",
       "batch_publishes_every_result accepts a partial final batch"),
    _m("MA19", "    if len(listed) != len(e.call_ids):\n        return False\n", "",
       "batch_names_its_calls accepts a call id listed twice"),
    _m("MA20", "                if record is not None and record.phase in (Phase.COMPLETED, "
               "Phase.REJECTED):",
       "                if record is not None and record.phase is Phase.COMPLETED:",
       "batch_names_its_calls forgets rejected calls an item names but call_ids omits"),
    _m("MA21", "return is_read_limit(", "return True or is_read_limit(",
       "read_limit_is_minimal checks only the bounds, never the recorded limit"),
    _m("MA22", "return s.continuation_after(e.call_ids) is e.continuation", "return True",
       "continuation_matches trusts the recorded continuation"),
    _m("MA23", 'S.UNSETTLED, None, "attempt_open", "envelope_reconcilable"),',
       'S.UNSETTLED, None, "attempt_open"),',
       "publication_failed's staying row drops envelope_reconcilable",
       equivalent="the fail-closed row comes first and needs only attempt_open besides "
                  "fail_closed, so the staying row is reached with an open attempt only "
                  "when the envelope is reconcilable"),
    _m("MA24", "return s.attempt_seq is None or e.take_over", "return True",
       "no_attempt_or_take_over ignores an open attempt (replay accepts a racing append)"),
    _m("MA25", '_row("claim", S.UNSETTLED, None, "envelope_reconcilable"),',
       '_row("claim", S.UNSETTLED, None),',
       "claim accepted on a fail-closed unsettled run"),
    _m("MA26", '(S.RUN_AGAIN, S.HANDOFF), S.AWAITING_MODEL,\n         "no_envelope", ',
       '(S.RUN_AGAIN, S.HANDOFF), S.AWAITING_MODEL,\n         ',
       "begin_model_call drops no_envelope",
       equivalent="an envelope exists only in UNSETTLED (staging enters it, settling "
                  "clears it, abandon leaves it for a terminal step), so no_envelope always "
                  "holds in RUN_AGAIN and HANDOFF"),
    _m("MA27", '_row("accept_final_output", S.TOOLS, S.FINAL_OUTPUT, "no_call_started"),',
       '_row("accept_final_output", S.TOOLS, S.FINAL_OUTPUT),',
       "a final output accepted while a tool is running"),
    _m("MA28", '(S.RUN_AGAIN, S.INTERRUPTION), S.HANDOFF, "no_envelope", "no_call_started"),',
       '(S.RUN_AGAIN, S.INTERRUPTION), S.HANDOFF, "no_envelope"),',
       "handoff drops no_call_started",
       equivalent="calls start only in TOOLS, and every way out of TOOLS but abandon "
                  "requires no_call_started, so no call is started in RUN_AGAIN or "
                  "INTERRUPTION"),
    _m("MA29", '"run_has_no_session", "nothing_unpublished"),', '"nothing_unpublished"),',
       "complete allowed for a run with a Session (its final batch never published)"),
    _m("MA30", '*_STAGE_CHECKS, "batch_publishes_every_result"),', "*_STAGE_CHECKS),",
       "a final-output batch may leave results unpublished"),
    _m("MA31", '"batch_names_its_calls", "batch_digests_match", "read_limit_is_minimal",',
       '"batch_names_its_calls", "read_limit_is_minimal",',
       "staging never checks the recorded batch digests"),
    _m("MA32", '("publication_committed", ("attempt_open",)),', '("publication_committed", ()),',
       "a commit accepted with no attempt open"),
    _m("MA33", '"no_envelope", "calls_are_new", "calls_without_approval"),',
       '"no_envelope", "calls_without_approval"),',
       "receive_tool_calls accepts an id the run already knows"),
    _m("MA34", "started.max_turns is not None and started.max_turns < 0",
       "started.max_turns is not None and started.max_turns <= 0",
       "replay refuses a log with max_turns=0"),
    _m("MA35", "if started.run_id != run_id or started.seq != 0:",
       "if started.seq != 0:",
       "replay loads another run's log under this run id"),
    # ------------------------------------------------------------- state: the fold
    _m("ST01", "    s.turns += 1\n    s.model_output = e.output",
       "    s.model_output = e.output",
       "turns never counted: max_turns never reached"),
    _m("ST02", "return (hook, self.model_calls)", "return (hook, self.activation)",
       "model hooks keyed per activation: the second model call skips model_start"),
    _m("ST03", "scope = result.call_id if stage in TOOL_STAGES else self.activation",
       "scope = result.call_id",
       "input/output guardrails keyed once per run instead of per activation"),
    _m("ST04", "self.unpublished_results() > len(call_ids)",
       "self.unpublished_results() >= len(call_ids)",
       "continuation off by one: a batch publishing every result continues to TOOLS"),
    _m("ST05", "if counts[_APPROVED] or self.unpublished_results()",
       "if self.unpublished_results()",
       "continuation forgets approved calls: a batch continues past unrun calls"),
    _m("ST06", "return self.policy is RecoveryPolicy.FAIL_CLOSED or not self.final_lossless",
       "return self.policy is RecoveryPolicy.FAIL_CLOSED",
       "a lossy final output no longer fails closed"),
    _m("ST07", "        del self.pending_guardrails[: len(envelope.guardrails)]\n", "",
       "settling publishes guardrails but keeps them pending (published twice)"),
    _m("ST08", "        del self.pending_input[: envelope.input_items]\n", "",
       "settling keeps published input pending (published again)"),
    _m("ST09", "        self.envelope = None\n        self.attempt_seq = None\n",
       "        self.envelope = None\n",
       "settling leaves the attempt open",
       equivalent="attempt_seq is read only in UNSETTLED (attempt_open, "
                  "no_attempt_or_take_over, reconcile, the Session write's id), every way "
                  "into UNSETTLED (PublicationStaged) sets it afresh, and holds_attempt also "
                  "needs the controller's own attempt, which the commit clears"),
    _m("ST10", "                if record.phase in (Phase.AWAITING, Phase.APPROVED):",
       "                if record.phase is Phase.APPROVED:",
       "a final output or handoff skips approved calls but leaves awaiting ones"),
    _m("ST11", "    record.starts += 1\n", "",
       "tool starts not counted"),
    _m("ST12", "    if record.phase != Phase.STARTED:\n        s._phase(record, Phase.STARTED)",
       "    s._phase(record, Phase.STARTED)",
       "a re-started call moves STARTED to STARTED",
       equivalent="_phase from a phase to itself decrements and increments the same count "
                  "and touches awaiting_ids only for AWAITING: no change"),
    _m("ST13", "        s.calls[call.call_id] = CallRecord(call, Phase.APPROVED)\n"
               "        s.counts[_APPROVED] += 1\n",
       "        s.calls[call.call_id] = CallRecord(call, Phase.APPROVED)\n",
       "received calls not counted as approved"),
    _m("ST14", "        if phase == Phase.AWAITING:\n"
               "            s.awaiting_ids[call.call_id] = None",
       "        pass",
       "calls needing approval not listed as pending approvals"),
    _m("ST15", "tuple(s.awaiting_ids), s.fails_closed()", "(), s.fails_closed()",
       "the envelope forgets the interruptions (I5)"),
    _m("ST16", "return n if n and len(items) >= n and list(items[:n]) == pending else 0",
       "return n",
       "pending input counted published by a batch that does not start with it"),
    _m("ST17", "def _failed(s: RunState, e: ev.PublicationFailed) -> None:\n"
               "    s.attempt_seq = None",
       "def _failed(s: RunState, e: ev.PublicationFailed) -> None:\n"
               "    return None",
       "a failed publication leaves its attempt open"),
    _m("ST18", "    if s.pending_input and step in STAGING_STEPS:",
       "    if s.pending_input and step is Step.RUN_AGAIN:",
       "recorded input published first only from RUN_AGAIN"),
    _m("ST19", "        if step is Step.HANDOFF and s.unpublished_results():\n"
               "            return Action.PUBLISH\n", "",
       "a handoff with unpublished results asks for the model first"),
    _m("ST20", "if s.session_id is not None or s.unpublished_results() or s.pending_guardrails:",
       "if s.session_id is not None or s.unpublished_results():",
       "FINAL_OUTPUT finishes with guardrail results unpublished"),
    _m("ST21", "if r.phase is Phase.STARTED and not r.call.idempotent and call_id not in "
               "in_flight",
       "if r.phase is Phase.STARTED and call_id not in in_flight",
       "an idempotent started call is reported in doubt"),
    _m("ST22", "            if phase is Phase.AWAITING:\n"
               "                state.awaiting_ids[record.call.call_id] = None\n", "",
       "restoring a snapshot loses the pending approvals"),
    _m("ST23", 'state.turns, state.model_calls = data["turns"], data["model_calls"]',
       'state.turns = data["turns"]',
       "restoring a snapshot forgets the model call count"),
    _m("ST24", "                if record.phase in (Phase.AWAITING, Phase.APPROVED):",
       "                if record.phase is Phase.AWAITING:",
       "a handoff (or a final output) keeps an approved, unstarted call runnable"),
    # ------------------------------------------------------------------- envelope
    _m("EN01", "    low = m + 1\n    if high < low:\n", "    low = m\n    if high < low:\n",
       "read_limit searched from len(B), not len(B) + 1"),
    _m("EN02", "for end in range(max(p, n), p + m + 1):", "for end in range(max(p, n), p + m):",
       "the full batch P + B is not compared with the partial writes"),
    _m("EN03", "    if session_id != envelope.session_id:\n"
               "        return Finding(FindingKind.SESSION_MISMATCH)\n",
       "",
       "reconcile accepts another Session's history"),
    _m("EN04", "    for k in range(1, len(b)):", "    for k in range(1, len(b) - 1):",
       "the partial write of all but the last item is not recognised"),
    _m("EN05", "tail = history[-n:] if len(history) > n else history", "tail = history[-n:]",
       "the tail slice without the length test",
       equivalent="read_limit is at least 2, and a slice [-n:] of a shorter list is the "
                  "whole list"),
    _m("EN06", "window = min(given, 2 * (m + 1))", "window = min(given, m + 1)",
       "the first window read is smaller",
       equivalent="the window only grows until a limit is found; the smallest limit "
                  "depends on the last n items alone, so the result is the same (only the "
                  "number of rounds differs)"),
    _m("EN07", "return Frontier(n, kept, whole and covers_all and len(kept) == given)",
       "return Frontier(n, kept, whole and covers_all)",
       "frontier marked whole although it keeps only part of the history"),
    _m("EN09", "return len({seq[end - n:end] for end in ends}) != len(ends)", "return True",
       "replay accepts a recorded read limit larger than the smallest"),
    _m("EN08", "    if seen == p[-n:]:\n        return Finding(FindingKind.APPEND)\n"
               "    if seen == (p + b)[-n:]:\n        return Finding(FindingKind.ACKNOWLEDGE)\n",
       "    if seen == (p + b)[-n:]:\n        return Finding(FindingKind.ACKNOWLEDGE)\n"
       "    if seen == p[-n:]:\n        return Finding(FindingKind.APPEND)\n",
       "acknowledge tested before append",
       equivalent="read_limit makes the n-item tails of P and P + B distinct, so at most "
                  "one of the two tests holds"),
    # ---------------------------------------------------------------------- codec
    _m("CO01", "        if type(value) is not kind:\n",
       "        if not isinstance(value, kind):\n",
       "strict hooks accept a subclass: True decodes as an int"),
    _m("CO02", '"RunClaimed": 2}', '"RunClaimed": 1}',
       "a version 1 document may hold RunClaimed"),
    _m("CO03", "if len(data) != len(fields) + 1 or any(f not in data for f in fields):",
       "if any(f not in data for f in fields):",
       "an event with an unknown field decodes"),
    _m("CO04", "tag = hmac.new(key, tag + canonical_json(raw), hashlib.sha256).digest()",
       "tag = hmac.new(key, canonical_json(raw), hashlib.sha256).digest()",
       "the keyed chain is not chained: only the last event is covered"),
    _m("CO05", "if len(raw_events) > max_events:", "if len(raw_events) > max_events + 1:",
       "max_events off by one on decode"),
    _m("SZ06", 'return f"(4 if {value} else 5)"', 'return f"(5 if {value} else 4)"',
       "the size of a bool field swapped"),
    _m("CO07", "+ max(len(events) - 1, 0))", "+ len(events))",
       "log_size counts one comma too many"),
    _m("CO08", "if version < 1 or (version < SCHEMA_VERSION and version not in UPCASTERS):",
       "if version < 0 or (version < SCHEMA_VERSION and version not in UPCASTERS):",
       "schema_version 0 slips past the first test",
       equivalent="0 has no upcaster, so the second test refuses it anyway"),
    _m("CO09", "    if measured is not None and measured > max_bytes:\n",
       "    if measured is not None and measured > max_bytes + 1:\n",
       "a document one byte over max_bytes decodes"),
    _m("CO10", "        if chain is None:\n            raise SchemaError(CHAIN_MISSING)\n"
               "        # every raw event decoded",
       "        if chain is None:\n            chain = chain_tag(key, raw_events)\n"
       "        # every raw event decoded",
       "a document without a chain passes the keyed check"),
    # ------------------------------------------------------------------ fastload
    _m("CO11", "            json.loads(text, parse_int=_digits_checked, "
               "parse_constant=_reject_constant)\n",
       "            pass\n",
       "an int past the 4,300-digit limit is refused as not valid JSON, not by its reason"),
    # ---------------------------------------------- a stored event's text (shared form)
    _m("CO12", "def _enum_value(member: Any) -> Any:\n    return member.value\n",
       "def _enum_value(member: Any) -> Any:\n    return member.name\n",
       "a stored event names its step, policy or resolution by its member's name"),
    _m("CO13", '        data: dict[str, Any] = {} if named is None else {"type": named}\n',
       "        data: dict[str, Any] = {}\n",
       "a stored event's text leaves out its type"),
    _m("SD22", "    with contextlib.suppress(Exception):  # (then `encode_event` decides)\n",
       "    if True:\n",
       "a payload json cannot serialize as it is (an object cattrs turns into a dict) "
       "refuses the append, where the document's encoding writes it"),
    _m("CO14", "        if type(value) is not cls:  # (a subclass has fields of its own: "
               "`encode_event`)\n",
       "        if False:\n",
       "a stored tool call of a subclass of ToolCall loses the subclass's own fields"),
    _m("FL01", "    if not encodable(compact) or _NUL in compact:\n        return None\n"
               "    return tree, compact",
       "    if _NUL in compact:\n        return None\n    return tree, compact",
       "a text holding a lone surrogate counts as clean: its string skips the text check"),
    _m("FL04", "    if not encodable(compact) or _NUL in compact:\n        return None\n"
               "    return tree, compact",
       "    if not encodable(compact):\n        return None\n    return tree, compact",
       "a text holding a NUL counts as clean: a NUL run id or tool name is decoded"),
    _m("FL05", "or not encodable(compact) or _NUL in compact:", "or not encodable(compact):",
       "a stored batch holding a NUL in a text field is decoded on the fast path"),
    _m("FL02", "        if event.seq != position:\n            return None\n", "",
       "a batch of stored rows whose bodies carry other seqs than their rows is accepted"),
    _m("FL03", 'lines.append(f"    if type({v}) is not int: raise _Slow")',
       'lines.append(f"    if not isinstance({v}, int): raise _Slow")',
       "the fast decoder takes True for an int field"),
    # ----------------------------------------------------------------- controller
    _m("CT03", '                trigger in ("publication_committed", "publication_failed")\n'
               "                and self.holds_attempt\n",
       '                trigger in ("publication_committed", "publication_failed")\n',
       "a fail-closed unsettled run lets a controller without the attempt commit"),
    _m("CT07", "                if not record.call.idempotent:\n"
               '                    self._refuse_in_doubt("begin_tool", call_id)\n', "",
       "begin_tool of an in-doubt call is refused by the guard, not ToolInDoubt"),
    _m("CT08", "        self._in_flight[call_id] = None\n", "",
       "a started call is not held in flight"),
    _m("CT09", "            if record.phase is Phase.COMPLETED:\n"
               "                if switch.telemetry:",
       "            if record.phase in (Phase.COMPLETED, Phase.PUBLISHED):\n"
       "                if switch.telemetry:",
       "a published call is re-sent"),
    _m("CT10", "at=self._clock()))\n        self._in_flight.pop(call_id, None)\n",
       "at=self._clock()))\n",
       "a completed call stays in flight"),
    _m("CT11", "if s.step is Step.INTERRUPTION and s.count(Phase.APPROVED):",
       "if s.step is Step.INTERRUPTION:",
       "resume records Resumed with nothing approved"),
    _m("CT12", "        doubtful = self.in_doubt()\n        if doubtful:\n"
               '            self._refuse_in_doubt("resume", doubtful[0])\n', "",
       "resume does not stop at an in-doubt call"),
    _m("CT13", "whole=whole or len(history) < len(batch) + 1)", "whole=whole)",
       "a history shorter than the batch + 1 is not taken as the whole Session"),
    _m("CT14", "        self._record(action, event)\n        self._attempt = event.seq\n"
               "\n    def _own_attempt",
       "        self._record(action, event)\n\n    def _own_attempt",
       "staging opens no attempt in the controller"),
    _m("CT15", "if s.attempt_seq is not None and not take_over:",
       "if s.attempt_seq is not None:",
       "reconcile ignores take_over"),
    _m("CT16", "items = tuple(copy_plain(item) for item in envelope.items)",
       "items = envelope.items",
       "Append hands out the envelope's own items (forgotten copy)"),
    _m("CT17", "        return attrs.evolve(envelope, items=tuple(copy_plain(i) for i in "
               "envelope.items),\n"
               "                            guardrails=tuple(ev.copied(g) for g in "
               "envelope.guardrails))",
       "        return envelope",
       "the envelope property hands out the live envelope (forgotten copy)"),
    _m("CT18", "return copy_plain(self._state.model_output)", "return self._state.model_output",
       "model_output hands out the state's own value (forgotten copy)"),
    _m("CT19", "if write.publication_id != self.publication_id:",
       "if not write.publication_id:",
       "a session_write under another attempt's publication id is accepted"),
    _m("CT22", 'f"call {excerpt(call_id)} is not in flight in this controller")\n'
               "        self._in_flight.pop(call_id, None)\n",
       'f"call {excerpt(call_id)} is not in flight in this controller")\n',
       "tool_interrupted keeps the call in flight"),
    _m("CT25", "        if call_id not in self._in_flight:\n"
               '            self._refuse(InvalidTransition, "tool_completed",',
       "        if False:\n"
       '            self._refuse(InvalidTransition, "tool_completed",',
       "a controller completes a call another process started (I11)"),
    _m("CT26", "        if call_id in self._in_flight:\n"
               "            self._refuse(InvalidTransition, action,\n"
               '                         f"call {excerpt(call_id)} is in flight in this '
               'controller; report "',
       "        if False:\n"
       "            self._refuse(InvalidTransition, action,\n"
       '                         f"call {excerpt(call_id)} is in flight in this '
       'controller; report "',
       "resolve_in_doubt accepted for a call still running here"),
    _m("CT27", "            self._attempt = None\n            if switch.enabled:\n"
               "                self._logged(commit.event, commit.source)",
       "            if switch.enabled:\n                self._logged(commit.event, commit.source)",
       "a commit with its Session write leaves the controller's attempt set",
       equivalent="holds_attempt also compares with the state's attempt_seq, which the "
                  "commit clears, and the next stage sets the attempt again"),
    _m("CT28", 'and "\\x00" not in value):', "and True):",
       "an ASCII text field holding a NUL passes the controller's fast check"),
    # -------------------------------------------------------------------- journal
    _m("JO30", "            return int(reader(run_id)) == 0\n", "            return False\n",
       "a sync store's missing run is looked for on a worker thread made for it (a thread "
       "per event loop, made and shut down for nothing)"),
    _m("JO27", "        self.riding = ()\n", "",
       "a Session write that rode is written again by the next flush"),
    _m("JO28", "        writes = list(self.riding)  #", "        writes = []  #",
       "a flush drops the Session writes that ride with it"),
    _m("JO29", "        return self.buffered and (not self.riding or "
               "many_session_writes(self.store))",
       "        return self.buffered",
       "a commit rides behind another on a store that takes one Session write per append"),
    _m("JO01", "max_events - RESERVED_EVENTS - max(_FINISHING.values()))",
       "max_events - RESERVED_EVENTS - 1)",
       "the hot path skips the room check too close to max_events"),
    _m("JO02", '_FINISHING = {"begin_tool": 3,', '_FINISHING = {"begin_tool": 1,',
       "a tool may start with no room left to record its result"),
    _m("JO04", "                    and error.outcome != Outcome.NOT_WRITTEN):\n"
               "                journal.stop(StorageError, _unknown(what))\n",
               "                    and error.outcome != Outcome.NOT_WRITTEN):\n"
               "                pass\n",
       "an append of unknown outcome does not stop the controller"),
    _m("JO05", "        if not self.buffered:\n            self.flushed = self.version\n", "",
       "an unbuffered controller forgets what the store holds"),
    _m("JO06", "        snapshot[SNAPSHOT_SIZE] = self.size  # how a load from it knows the size\n",
       "",
       "snapshots carry no log size",
       equivalent="a load from a snapshot without the size reads it off the log "
                  "(_snapshot_size): the same size, one read more"),
    _m("JO20", "        if room < needed:\n", "        if room < needed - 1:\n",
       "max_events room check off by one"),
    _m("JO21", "            if journal is not None and journal.buffered:  # they stay behind, "
               "refused\n"
               "                journal.stop(ConcurrencyConflict,\n"
               "                             f\"this controller's buffered events were refused "
               "({what}): \"\n"
               "                             \"another writer moved the log; load the run again "
               "to go on\")\n", "",
       "a buffered controller goes on after its events were refused"),
    _m("JO23", "if base + len(tail.events) > max_events:", "if len(tail.events) > max_events:",
       "a snapshot load does not count the events before the snapshot"),
    _m("JO24", "            if replay(state.run_id, [*prefix, *self.events]) != state:",
       "            if False:",
       "an edited log before the snapshot is handed out as the run's events"),
    _m("JO25", "        if found != self.flushed:\n", "        if False:\n",
       "the fence passes an attempt another attempt superseded"),
    _m("JO26", "            self.stop(ConcurrencyConflict, reason)\n", "",
       "a fenced controller goes on recording as if it still held the run"),
    _m("JO31", "        return any(type(e) in _RESULTS for e in "
               "self.events[self.flushed - self.base:])",
       "        return False",
       "a tool's result waits through the next model call: a crash then leaves the call "
       "in doubt"),
    # --------------------------------------------------------------------- stores
    _m("SS01", "            if len(log) != expected_version:\n",
       "            if len(log) > expected_version:\n",
       "the memory store appends past a gap (expected version ahead of the log)"),
    _m("SS02", "self._snapshots[run_id] = (expected_version, snapshot)",
       "self._snapshots[run_id] = (expected_version + len(events), snapshot)",
       "the memory store files a snapshot under the wrong version"),
    _m("SS03", "            elif claimed:\n                self._owners[run_id] = owner\n", "",
       "the memory store never updates the owner after the first append"),
    _m("SS04", "return list(self._logs.get(run_id, ()))", "return self._logs.get(run_id, [])",
       "the memory store hands out its own log list (forgotten copy)"),
    _m("SS05", "        if any(event.seq != expected_version + i for i, event in "
               "enumerate(events)):",
       "        if False:",
       "the memory store appends events whose sequence numbers do not follow the log"),
    _m("SS06", "        events = tuple(events)  # read once", "        pass  # read once",
       "the memory store reads an append's events twice: an iterator's land as nothing"),
    _m("SD05", "    if state.run_id != run_id:\n"
               "        snapshot_ignored(run_id, \"it is another run's\")\n"
               "        return None\n", "",
       "another run's snapshot is restored"),
    _m("SD06", "if tail and tail[0].seq != state.last_seq + 1:",
       "if tail and tail[0].seq < state.last_seq + 1:",
       "a snapshot followed by a gap is restored"),
    _m("SQ07", "            if version != expected_version:\n",
       "            if version > expected_version:\n",
       "the SQLite store appends past a gap"),
    _m("SQ08", "(value, owner if claimed else row[0], version, at, *lease, model, kind,",
       "(value, owner, version, at, *lease, model, kind,",
       "the SQLite store clears the owner on an append without a claim"),
    _m("SQ17", "    if head is not None and head != first + len(loaded.events):\n",
       "    if head is not None and head < first + len(loaded.events):\n",
       "a SQLite log that lost its last rows loads as a shorter log"),
    _m("SQ18", '            _checked(run_id, head, version, Loaded([]), "append")\n', "",
       "an append writes on top of a SQLite log that lost its last rows"),
    _m("SQ19", "                head = self._head_version(conn, run_id)\n"
               "                return head, ",
       "                head = None\n                return head, ",
       "the whole-log load of a SQLite run skips the head check"),
    _m("SQ20", "        version = expected_version + len(events)\n",
       "        version = expected_version + 1\n",
       "a SQLite append of several events moves its head by one"),
    _m("SQ21", "self._upgrade(_has_version, _HEAD_VERSION, _FILL_VERSIONS)",
       "self._upgrade(_has_version, _HEAD_VERSION)",
       "an older database's heads get a version column but no versions"),
    _m("SQ09", "if present != (1 if version == 1 else 2):", "if present < 1:",
       "a truncated log under a verified snapshot is not noticed"),
    _m("SD10", "    if not hmac.compare_digest(digest(body), stored):\n"
               '        return None, "its digest does not match its text"\n', "",
       "a snapshot whose digest does not match is used"),
    _m("SD11", "        if event.seq != seq:\n", "        if event.seq < seq:\n",
       "a stored body carrying a later seq than its row is accepted"),
    _m("SQ12", "        if not landed:\n            raise failure(",
       "        if landed:\n            raise failure(",
       "a lost COMMIT classified backwards (swapped branch)"),
    _m("SD13", "    if expected_version != 0 or not events:\n        return None\n",
       "    if not events:\n        return None\n",
       "every append without a step is folded",
       equivalent="a later batch does not start with RunStarted, so replaying it raises "
                  "and the step stays None, as before"),
    # --------------------------------------------------------------------- sqlite
    _m("SQ01", 'conn.execute("PRAGMA synchronous=FULL")',
       'conn.execute("PRAGMA synchronous=NORMAL")',
       "no fsync per commit (a power cut loses acknowledged appends)"),
    _m("SQ02", '    conn.execute("BEGIN IMMEDIATE")\n    try:\n        yield conn',
       '    conn.execute("BEGIN")\n    try:\n        yield conn',
       "deferred write transactions: writers deadlock instead of queueing"),
    _m("SQ03", "        with contextlib.suppress(sqlite3.Error):\n"
               '            conn.execute("ROLLBACK")\n        raise\n',
       "        raise\n",
       "a failed write transaction is not rolled back"),
    _m("SQ04", "            if now == self._identity:\n                return\n",
       "            return\n",
       "a replaced database file is not noticed"),
    _m("SQ05", "    except sqlite3.Error as error:\n"
               "        raise CommitFailed(str(error)) from error",
       "    except sqlite3.Error:\n        raise",
       "a failed COMMIT reported as not written without reading back"),
    # ------------------------------------------------------------------- sessions
    _m("SE01", "self._items[-limit:] if limit > 0 else []", "self._items[-limit:]",
       "MemorySession.get_items(limit=0) returns the whole history"),
    _m("SE02", "copies = [detach(item) for item in items]", "copies = list(items)",
       "MemorySession keeps the caller's items (forgotten copy)"),
    _m("SQ13", "(session_id, max(limit, 0))", "(session_id, limit)",
       "a Session's tail read with a negative limit (by the Session or its store) returns "
       "everything"),
    _m("SQ14", '" ORDER BY id DESC LIMIT ?) ORDER BY id", (session_id',
       '" ORDER BY id DESC LIMIT ?)", (session_id',
       "a Session's tail (read by the Session or its store) comes back newest first"),
    _m("SQ15", '"ORDER BY id DESC LIMIT 1", (self.session_id,)).fetchone()',
       '"ORDER BY id LIMIT 1", (self.session_id,)).fetchone()',
       "SQLiteSession.pop_item removes the oldest item"),
    _m("SQ24", "return 0 if row is None or row[0] is None else int(row[0]) + 1",
       "return 0 if row is None or row[0] is None else int(row[0])",
       "the SQLite store's version is one short: every fence refuses its own run"),
    _m("SQ25", "                    conn.execute(_SESSION_INDEX)\n",
       "                    conn.execute(_SESSION_INDEX)\n"
       "                    self._session_table = True\n",
       "the store takes the Session's table as made in an append that then rolls back, and "
       "the next append of items fails: no such table"),
    _m("SQ26", "            return _session_bodies(conn, session_id, limit)",
       "            return _session_bodies(conn, session_id, None)",
       "the store reads a Session's whole history where its tail was asked for"),
    _m("SQ16", "        if type(session_id) is str and (problem := text_problem(session_id)) "
               "is not None:", "        if False:",
       "SQLiteSession takes a session id with a NUL, which PostgreSQL refuses"),
    _m("SQ22", "        return await self._off_loop(self._get_items, limit)",
       "        return self._get_items(limit)",
       "SQLiteSession.get_items reads on the event loop, which stops while it waits"),
    _m("SQ23", "        await self._off_loop(self._add_items, bodies)",
       "        self._add_items(bodies)",
       "SQLiteSession.add_items writes on the event loop, which stops for its fsync"),
    # ------------------------------------------------------- time and actor (§7.2)
    _m("SZT1", '"< 10_000_000_000_000_000 else', '"<= 10_000_000_000_000_000 else',
       "a 17-digit at is sized as 16 digits"),
    _m("COT1", "        if present:\n", "        if False:\n",
       "a version 2 document whose events carry version 3 fields loads"),
    _m("COT2", "chain_tag(key, signed_events)", "chain_tag(key, raw_events)",
       "the chain of an older document is checked over its upcast events"),
    _m("COT3", "        if added is not None and not any(key in data for key in added):\n"
               "            data = {**data, **added}\n", "",
       "a stored event of an older library (no at) no longer loads"),
    _m("COT4", "append({**event, **added})", "append(event)",
       "the version 2 upcaster gives the events no at, by or reason"),
    _m("CTT1", "        at = event.at\n        if type(at) is not int or not 0 <= at <= _MAX_AT:\n"
               "            self._refuse(SchemaError, action, _BAD_CLOCK)\n"
               "        if journal.write is not None:",
       "        if journal.write is not None:",
       "a clock reading that is not microseconds is recorded"),
    _m("CTT2", "at=self._clock(), by=by, reason=reason))", "at=self._clock(), by=by))",
       "an approval's reason is not recorded"),
    _m("CTT3", "bound, detached,\n" + " " * 45 + "at=self._clock(), by=by))\n",
       "bound, detached,\n" + " " * 45 + "at=self._clock()))\n",
       "a rejection's actor is not recorded"),
    _m("CTT4", '        clock = _check_clock(clock, {"action": "load"})\n        with gc_paused():',
       '        clock = _check_clock(clock, {"action": "load"})\n'
       '        _read_clock(clock, {"action": "load"})\n        with gc_paused():',
       "from_json reads the clock while it replays"),
    _m("STT1", "    record.decided = e\n    s._phase(record, Phase.APPROVED)",
       "    s._phase(record, Phase.APPROVED)",
       "the ledger forgets who approved a call"),
    _m("STT2", "    record.resolutions = (*record.resolutions, e)\n", "",
       "the ledger forgets who resolved a call in doubt"),
    _m("STT4", "    if e.outcome is Resolution.NOT_EXECUTED:  # runnable again, its approval kept",
       "    if e.outcome is Resolution.FAILED:",
       "a call resolved NOT_EXECUTED stays completed (its effect is never made)"),
    _m("STT5", "                                       for e in resolutions)",
       "                                       for e in resolutions[:0])",
       "a run restored from a snapshot forgets the resolutions of its calls"),
    _m("CTL5", "        if outcome is Resolution.NOT_EXECUTED and output is not None:",
       "        if outcome is Resolution.NOT_EXECUTED and output is None and False:",
       "NOT_EXECUTED records an output the model never sees"),
    _m("INV1", "            if (starts[event.call_id] > 1 + released[event.call_id]",
       "            if (starts[event.call_id] > 2 + released[event.call_id]",
       "the log checker lets a non-idempotent call start twice"),
    _m("VE01", "        controller.resolve_in_doubt(call_id, answer.output, by=by)",
       "        controller.resolve_in_doubt(call_id, answer.output)",
       "a verifier's answer is recorded without saying it was the verifier's"),
    _m("VE02", "        controller.resolve_in_doubt(call_id, outcome=Resolution.NOT_EXECUTED, "
               "by=by)",
       "        controller.resolve_in_doubt(call_id, by=by)",
       "a NotExecuted answer settles the call as completed (the charge is never made)"),
    _m("VE03", "            answer: Any = await asyncio.wait_for(pending, timeout)",
       "            answer: Any = await asyncio.wait_for(pending, None)",
       "a verifier that never answers holds the attempt for good"),
    _m("VE04", "                       max(starts, 1))", "                       starts + 1)",
       "the tool context says a first start is the second"),
    _m("AT06", "            if verifiable:  # the first effect: ask what happened, record it, "
               "durably",
       "            if False:",
       "an attempt never asks the verifiers: every call in doubt waits for a person"),
    _m("AT07", "            if self._gated and doubtful and not verifiable:  # the gate refuses it",
       "            if self._gated and doubtful:  # the gate refuses it",
       "a call in doubt with a verifier is refused before its verifier is asked"),
    _m("LP17", "            with running_call(self.controller, call.call_id):  "
               "# tool_context()\n",
       "            if True:\n",
       "a tool body of the reference runner has no tool context (no idempotency key)"),
    _m("AN21", "    if names:\n        raise UnsupportedFeature(\n            f\"MCP tools",
       "    if False:\n        raise UnsupportedFeature(\n            f\"MCP tools",
       "tools the SDK's MCP helpers made run as function tools (a lost response answered)"),
    _m("OP01", "    if type(by) is not str or not by.strip():", "    if type(by) is not str:",
       "an operator's command is recorded without saying who acted"),
    _m("OP02", "    try:\n        c.claim(by)\n", "    try:\n        pass\n",
       "an operator's command does not claim the run (a running attempt is not fenced)"),
    _m("OP03", "        if not (settling and c.step is Step.UNSETTLED):", "        if True:",
       "an unsettled run that fails closed can no longer be abandoned by an operator"),
    _m("OP04", "        command(c)\n        c.flush()\n", "        command(c)\n",
       "the sync commands return before anything is durable"),
    _m("OP05", "        command(c)\n        await c.flush_async()\n", "        command(c)\n",
       "the async commands return before anything is durable"),
    _m("OP06", "    if type(fingerprint) is not str or not fingerprint:", "    if False:",
       "an approval without a fingerprint is not refused as such"),
    _m("OP07", "resolve_in_doubt(call_id, output, outcome=outcome, by=by,",
       "resolve_in_doubt(call_id, output, by=by,",
       "the operator's outcome is dropped (every resolution says COMPLETED)"),
    _m("OP08", "lambda c: c.reject(call_id, message, by=by)",
       "lambda c: c.reject(call_id, None, by=by)",
       "the rejection message the operator gave is lost"),
    _m("OP09", "[h for h in heads if h.blocker is not None] if blocked else heads",
       "heads", "runs --blocked lists runs nothing blocks"),
    _m("OP10", "lambda c: c.abandon(reason, by=by)", "lambda c: c.abandon(reason)",
       "an abandon does not record who abandoned the run"),
    _m("OP12", "    if not callable(getattr(store, \"list_runs\", None)):",
       "    if False:", "a store without run heads is not refused by name"),
    _m("OP13", "    found.sort(key=lambda w: (w.since is None, w.since or 0, w.run_id))\n", "",
       "the inbox lists runs by id instead of oldest first"),
    _m("OP14", "    if any(misprints(c) for c in by):\n", "    if False:\n",
       "an operator's name that reads as another (a direction override) or as nothing is "
       "recorded"),
    _m("OP15", "    if type(reason) is str and not reason.strip():\n", "    if False:\n",
       "a run is abandoned with a blank reason"),
    _m("OP11", "lambda c: c.approve(call_id, fingerprint=fingerprint, by=by, reason=reason)",
       "lambda c: c.approve(call_id, by=by, reason=reason)",
       "an operator's approval does not bind to the fingerprint it was shown"),
    _m("STT3", "                record.decided = codec.decode_stored_event(decided, 0)",
       "                pass",
       "a run restored from a snapshot forgets who decided its calls"),
    _m("JOT1", "ev.Abandoned(seq, text, at=at, by=text)", "ev.Abandoned(seq, text, at=at)",
       "the byte reserve has no room for who abandons the run"),
    _m("SST1", "self._owners.get(run_id), log[-1].at, holder,",
       "self._owners.get(run_id), log[0].at, holder,",
       "the memory store's head says when the run started, not when it last moved"),
    _m("SQT1", "(value, owner if claimed else row[0], version, at, *lease, model, kind,",
       "(value, owner if claimed else row[0], version, None, *lease, model, kind,",
       "the SQLite head keeps the time of the run's first append"),
    _m("SQT2", '                      "ALTER TABLE runs ADD COLUMN updated_at INTEGER")\n',
       '                      "SELECT 1")\n',
       "an older SQLite database is not given its updated_at column"),
    _m("SQT3", "        self._has_updated_at = timed\n", "",
       "a read-only look at an older SQLite database selects a column it does not have"),
    # ------------------------------------------------------------------- postgres
    _m("PG01", '"WHERE run_id = %(run)s AND version = %(expected)s AND (NOT %(claimed)s "',
       '"WHERE run_id = %(run)s AND (NOT %(claimed)s "',
       "the PostgreSQL append does not check the expected version"),
    _m("PG02", "    if version != first + len(events):\n",
       "    if version < first + len(events):\n",
       "a PostgreSQL log shorter than its head is not noticed"),
    _m("PG03", '"owner = CASE WHEN %(claimed)s THEN %(owner)s::text ELSE owner END, "',
       '"owner = %(owner)s::text, "',
       "the PostgreSQL head loses its owner on an append without a claim"),
    _m("PG04", '"session_id = %s ORDER BY id DESC LIMIT %s) AS tail ORDER BY id")',
       '"session_id = %s ORDER BY id DESC LIMIT %s) AS tail")',
       "PostgresSession's tail comes back in no defined order"),
    _m("PG05", "        raise ConfigurationError(f\"schema must be a plain SQL identifier",
       "        raise ValueError(f\"schema must be a plain SQL identifier",
       "a bad schema= name is an untyped ValueError"),
    _m("PG06", "        if (problem := text_problem(session_id)) is not None:  # PostgreSQL",
       "        if False and (problem := text_problem(session_id)) is not None:  # PostgreSQL",
       "a PostgreSQL Session takes a session id with a NUL and fails on every call"),
    _m("PG07", "    text = redact(text, secrets)\n", "",
       "a backend error's message quotes the DSN's password libpq echoed"),
    _m("PG08", '        return None if any(secret in text for secret in self._secrets) else error',
       "        return error",
       "an error quoting the DSN's password is chained as the cause a traceback prints"),
    _m("PG09", '            userinfo = rest[:rest.rindex("@")]',
       '            userinfo = rest[:rest.index("@")]',
       "a URI password holding an @ is redacted only up to its first @"),
    _m("PG10", "    found.update([unquote(secret) for secret in found])\n", "",
       "a URI's percent-encoded password is not redacted as libpq decodes it"),
    _m("PG11", "            found.add(re.sub(", "            found.discard(re.sub(",
       "a quoted key=value password is redacted only with its quotes"),
    _m("PA04", "                                **where) from self._cause(error)\n",
       "                                **where) from error\n",
       "a connect error quoting the DSN's password is chained as the printed cause"),
    _m("PG13", "        if self.lock_timeout is not None:  # ms",
       "        if False:  # ms",
       "no lock_timeout is set: an append waits as long as another session holds its head"),
    _m("PG14", "max(1, math.ceil(self.lock_timeout * 1000))", "math.ceil(self.lock_timeout)",
       "lock_timeout is handed to PostgreSQL in seconds where it reads milliseconds"),
    _m("PG15", "or not 0 < lock_timeout < 2**31 / 1000):",
       "or not 0 <= lock_timeout):",
       "lock_timeout=0 (PostgreSQL: wait for ever) or a huge one is taken"),
    _m("PG16", "        super().__init__(dsn, schema=schema, lock_timeout=lock_timeout)",
       "        super().__init__(dsn, schema=schema)",
       "a PostgreSQL Session ignores its lock_timeout"),
    _m("PGT1", '"updated_at = %(at)s, "', '"updated_at = updated_at, "',
       "the PostgreSQL head keeps the time of the run's first append"),
    _m("PGT2", "2: (*sql.ddl_3, *sql.ddl_4, *sql.ddl_5),", "2: (*sql.ddl_4, *sql.ddl_5),",
       "a version 2 PostgreSQL schema is labelled current without its updated_at column"),
    _m("PGT3", '            sql.heads = sql.heads.replace("updated_at", "NULL::bigint")\n',
       "            pass\n",
       "a read-only store on a version 2 schema selects a column it does not have"),
    # ---------------------------------------------------------------- leases (§7.2)
    _m("SD20", "        if write.whole:\n            return True\n", "",
       "a write staged against a whole Session lands on one that holds items before them"),
    _m("SD21", "    if after is None:\n        return False\n",
       "    if after is None or not write.whole:\n        return False\n",
       "a write staged against a Session's tail is never checked, only a whole Session's"),
    _m("SQ30", "                    if session_moved(write, _session_bodies(conn, "
               "write.session_id,",
       "                    if False and session_moved(write, _session_bodies(conn, "
       "write.session_id,",
       "the SQLite store writes a publication onto a Session another writer moved"),
    _m("SQ31", "                    conn.executemany(_INSERT_ITEM, a.items[start:position])\n"
               "                    start = position\n", "",
       "the SQLite store checks each write's tail before the writes before it are in"),
    _m("SQ32", "                                tuple(held) if headed else None)",
       "                                None)",
       "the SQLite store takes every run for one without a head and inserts a second one"),
    _m("SQ33", "                                tuple(held) if headed else None)",
       "                                tuple(held))",
       "the SQLite store moves a head that is not there (a run an older writer logged): "
       "the run is left without one"),
    _m("SQ34", "        events = tuple(events)  # read once", "        pass  # read once",
       "the SQLite store reads an append's events twice: an iterator's rows land with the "
       "head left behind them, and the run never loads again"),
    _m("PG37", "    events = tuple(events)  # read once", "    pass  # read once",
       "the PostgreSQL store reads an append's events twice: an iterator's append writes "
       "nothing and says it landed"),
    _m("SQ35", "            raise self._closed_error(getattr(fn, \"__name__\", \"call\"), of_run) "
               "from None",
       "            raise",
       "a closed async SQLite store's calls raise the shut-down worker's RuntimeError, not "
       "StorageError"),
    _m("SQ36", "            raise StorageError(f\"cannot {doing}: the Session {self.session_id!r} "
               "is closed\",",
       "            raise\n            raise StorageError(f\"cannot {doing}: the Session "
               "{self.session_id!r} is closed\",",
       "a closed SQLiteSession's calls raise the shut-down worker's RuntimeError"),
    _m("PG30", "        if session_moved(write, [body for (body,) in answers[at]]):",
       "        if False:",
       "the PostgreSQL store writes a publication onto a Session another writer moved"),
    _m("PG31", '{**rows, "tail": len(write.after) + 1}, "all"))',
       '{**rows, "tail": len(write.after)}, "all"))',
       "the PostgreSQL store writes onto a whole Session that holds items before them"),
    _m("PG32", "    sessions = [] if locked else locked_sessions([a])\n",
       "    sessions = []\n",
       "the PostgreSQL store checks a Session's tail while another writer's rows, their ids "
       "taken, are not committed yet"),
    _m("PG35", "                                  \"SELECT body FROM tail ORDER BY id\")",
       "                                  \"SELECT body FROM tail ORDER BY id DESC\")",
       "a checked write reads the Session's tail backwards and refuses writes that should "
       "land"),
    _m("PA30", "            if sessions:  # every Session's lock before any run's row, outside "
               "the savepoints\n", "            if False:\n",
       "a group takes each Session's lock with its append, after other runs' rows: two "
       "stores' groups deadlock"),
    _m("PA31", "                    begin = (\"SAVEPOINT one_append\",)",
       "                    begin = ()",
       "in a group, an append refused after one that landed rolls that one back too, "
       "which its caller is told landed"),
    _m("PA32", "                UNPREPARED.add(conn)\n", "                pass\n",
       "a statement behind another in a pipeline is prepared: when the one before it fails, "
       "psycopg counts it prepared while the server skipped it, and every later append "
       "fails"),
    _m("PA33", "                                        a.params, prepare=prepared(conn))",
       "                                        a.params)",
       "an append of events alone uses a statement psycopg counts as prepared while the "
       "server skipped its PREPARE in a refused pipeline: every such append fails"),
    _m("PG36", "    answers = yield Batch(tuple(batch))\n    if a.count:",
       "    if a.snapshot is not None:\n        batch.append(Query(sql.snapshot, a.snapshot))\n"
       "    answers = yield Batch(tuple(batch))\n    if a.count:",
       "a stale append writes its snapshot before its version is judged: it waits for the "
       "snapshot row an append in flight holds, and fails with StorageError"),
    _m("PG33", "    yield Batch((Query(sql.lock_session, (rows[\"session\"],), \"one\"),\n"
               "                 Query(sql.add_items, rows)))",
       "    yield Query(sql.add_items, rows)",
       "PostgresSession writes without the Session's lock: a check under way misses it"),
    _m("JO40", "            elif (journal is not None and journal.buffered\n",
       "            elif (False and journal is not None and journal.buffered\n",
       "a buffered controller whose riding write was refused goes on as if it landed"),
    _m("CT30", "        return SessionWrite(write.session_id, write.publication_id, items, after,\n"
               "                            write.whole)",
       "        return SessionWrite(write.session_id, write.publication_id, items)",
       "publication_committed drops the tail a Session write was staged against"),
    _m("LP30", "                await c.flush_async()  # an effect boundary: the start is durable "
               "first\n                self.known = None\n",
       "                await c.flush_async()  # an effect boundary: the start is durable "
       "first\n",
       "the runner keeps the Session it read across a tool, which may have written to it"),
    _m("LP31", "                await _before_user_code(c)  # a superseded attempt runs no hook "
               "(I1)\n                self.known = None\n",
       "                await _before_user_code(c)  # a superseded attempt runs no hook (I1)\n",
       "the runner keeps the Session it read across a hook, which may have written to it"),
    _m("LP32", "        await _before_user_code(c)  # a superseded attempt runs no guardrail "
               "(I1)\n        self.known = None\n",
       "        await _before_user_code(c)  # a superseded attempt runs no guardrail (I1)\n",
       "the runner keeps the Session it read across a guardrail, which may have written to it"),
    _m("LP33", "            self.known = None  # the consumer's code ran meanwhile\n", "",
       "the runner keeps the Session it read while a stream's consumer ran"),
    _m("LP34", "            self.known.extend(_copied(item) for item in items)\n",
       "            pass\n",
       "the Session the runner keeps misses what it published"),
    _m("LP36", "        if not self.own_hooks:  # (the library's own ran nothing since the "
               "flush before\n",
       "        if False:  # (the library's own ran nothing since the flush before\n",
       "a tool runs after a start hook of the user's during which another attempt claimed "
       "the run"),
    _m("LP37", '        self.own_hooks = type(hooks) is RunHooks and not getattr(hooks, '
               '"__dict__", None)',
       "        self.own_hooks = type(hooks) is RunHooks",
       "a hook set on a RunHooks instance is taken for the library's own: no fence before "
       "the tool body after it"),
    _m("LP35", "        return [_copied(item) for item in self.known]",
       "        return self.known",
       "the model is handed the Session the runner keeps, and what it changes there is "
       "what the next publication is staged against"),
    _m("SDL1", "    if until is not None and now < until and any(",
       "    if until is not None and now > until and any(",
       "a live lease lets anyone claim and an ended one refuses every other owner"),
    _m("SDL2", "        return lease if length is None else (holder, now + length, length)",
       "        return lease",
       "the holder's appends never renew its lease: a live worker loses the run"),
    _m("SDL3", "    if last.lease is None:\n        return NO_LEASE\n",
       "    if last.lease is None:\n        return lease\n",
       "a claim without a lease keeps the lease it follows"),
    _m("CTL1", '        if owner is None:\n            self._refuse(SchemaError, action, "a lease',
       '        if False:\n            self._refuse(SchemaError, action, "a lease',
       "a lease without an owner is taken: nobody can renew or reclaim it"),
    _m("CTL2", "not 0 < lease <= MAX_LEASE:", "not 0 <= lease:",
       "a zero, an infinite or a huge lease is taken"),
    _m("CTL3", "at=self._clock(),\n                                           lease=length))",
       "at=self._clock()))",
       "a claim's lease is never recorded: no store keeps it"),
    _m("SSL1", "            if lease is not NO_LEASE or any(type(event) is RunClaimed",
       "            if any(type(event) is RunClaimed",
       "the memory store never renews a lease"),
    _m("SQL1", "        if claimed or lease[2] is not None:  # no lease involved: no clock read",
       "        if claimed:",
       "the SQLite store never renews a lease"),
    _m("SQL2", "                    self._ensure_leases()\n", "",
       "an older SQLite database is not given its lease columns"),
    _m("SQM1", '"&readonly_shm=1"', '""',
       "a read-only store writes its read marks into the -shm a writer left"),
    _m("PGL1", '"OR lease_until IS NULL OR lease_until <= now.us "', '"OR TRUE "',
       "the PostgreSQL store takes a claim over another owner's live lease"),
    _m("PGL2", '"ELSE lease END FROM now "', '"ELSE NULL END FROM now "',
       "an append of the PostgreSQL lease holder ends its lease instead of renewing it"),
    _m("PGL3", "3: (*sql.ddl_4, *sql.ddl_5),", "3: sql.ddl_5,",
       "a version 3 PostgreSQL schema is labelled 4 without its lease columns"),
    _m("PGL4", "    if row is not None and row[0] == a.expected and a.params[\"claimed\"]",
       "    if False and row is not None and row[0] == a.expected and a.params[\"claimed\"]",
       "a claim a live lease refused is reported as a lost race, naming no holder"),
    _m("PGL5", '"NULL::text, NULL::bigint")', '"lease_owner, lease_until")',
       "a read-only store on a version 3 schema selects lease columns it does not have"),
    _m("PA01", "decided = fenced or not one_statement(prepared)", "decided = True",
       "a lost one-statement append that could not be fenced is guessed not written"),
    _m("PA02", "raise self._failure(error, doing=doing, outcome=Outcome.UNKNOWN,\n",
       "raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,\n",
       "a Session write whose COMMIT raised is reported as not written"),
    _m("PA03", "return None, await self.load_measured(run_id)", "return None, tail",
       "an ignored snapshot's store hands back no events instead of the whole log"),
    _m("PA05", "return int(rows[0][0]) if rows else 0", "return 0",
       "the PostgreSQL store's version is always 0: a superseded attempt is never fenced"),
    _m("PAG1", "GROUP_LIMIT = 64\n", "GROUP_LIMIT = 1\n",
       "the async PostgreSQL store commits every append on its own: no group commit"),
    _m("PAG2", "                    if not _in_transaction(conn):  # the group's",
       "                    if True:  # the group's",
       "one run's refused append in a group fails every append of the group"),
    _m("PAG3", 'await conn.execute("ROLLBACK TO SAVEPOINT one_append")',
       'await conn.execute("SELECT 1")',
       "a server error in one append of a group leaves the group's transaction failed"),
    _m("PAG4", "key=lambda j: group[j].run_id)", "key=lambda j: 0)",
       "a group takes its runs' heads in arrival order: two stores' groups deadlock"),
    _m("PAG5", "        if len(group) == 1:\n", "        if False:\n",
       "a lone append goes through a savepoint: more round trips than a single statement"),
    _m("PAG6", "                    if not done.done():\n                        taken",
       "                    if True:\n                        taken",
       "an append cancelled before its group was taken is written anyway"),
    _m("PAG7", "await self._classify(error, group[i], in_transaction=True)", "pass",
       "a group whose COMMIT was lost is taken as landed without reading a batch back"),
    # ---------------------------------------------------------------- runner/loop
    _m("LP01", "            await call()\n            c.hook_ran(hook, call_id=call_id)",
       "            c.hook_ran(hook, call_id=call_id)\n            await call()",
       "a hook recorded before it ran (a crash between loses it)"),
    _m("LP02", "if c.max_turns is not None and c.turns >= c.max_turns:",
       "if c.max_turns is not None and c.turns > c.max_turns:",
       "max_turns checked off by one"),
    _m("LP03", "        await c.flush_results_async()\n        try:\n            response",
       "        try:\n            response",
       "the model is called by an attempt another has superseded"),
    _m("LP21", "        await c.flush_results_async()\n", "        await c.fence_async()\n",
       "a tool's result waits through the next model call: a crash then leaves the call "
       "in doubt"),
    _m("LP22", "            elif action is Action.AWAIT_DECISIONS:\n"
               "                await c.flush_async()", "            elif action is "
               "Action.AWAIT_DECISIONS:\n                pass",
       "a streamed consumer is shown a pause that is not durable"),
    _m("LP23", "        await c.flush_async()\n        await self._emit(StreamEvent("
               "\"final_output\"", "        await self._emit(StreamEvent(\"final_output\"",
       "a streamed consumer is shown an answer that is not durable"),
    _m("LP04", "                await c.flush_async()  # an effect boundary: the start is "
               "durable first\n", "",
       "a tool runs before its start is durable"),
    _m("LP05", "        if recorded is not None:\n"
               '            return Verdict(recorded.result["behavior"], '
               'recorded.result["message"])\n', "",
       "a guardrail that already ran runs again on resume"),
    _m("LP06", 'if outcome.behavior == "reject_content" and verdict is ALLOW:',
       'if outcome.behavior == "reject_content":',
       "the last rejecting tool guardrail wins instead of the first"),
    _m("LP07", 'return checked.message if checked.behavior == "reject_content" else output',
       "return output",
       "a tool output guardrail's rejection is ignored"),
    _m("LP08", '                c.abandon(f"output guardrail {guard.name}")\n', "",
       "an output guardrail tripwire leaves the run live"),
    _m("LP09", "        await one_writer(c, self.session, read=self.known)\n", "",
       "the one-writer check is skipped (§6.4)"),
    _m("LP12", "            if progress == (c.version, action):", "            if False:",
       "no guard against a loop that records nothing"),
    _m("LP13", "items: list[JSON] = list(c.unpublished_input)", "items: list[JSON] = []",
       "input recorded before a crash is never published"),
    _m("LP14", "final_output=c.final_output if c.step is Step.COMPLETED else None,",
       "final_output=c.final_output,",
       "a paused run reports a final output",
       equivalent="a result is built only at COMPLETED and when the run pauses in "
                  "INTERRUPTION, and no final output is ever accepted before INTERRUPTION "
                  "(accepting one leads only to FINAL_OUTPUT, then COMPLETED or a terminal "
                  "step), so final_output is None there either way"),
    _m("LP15", "                await _before_user_code(c)  # a superseded attempt runs no hook "
               "(I1)\n",
       "                pass\n",
       "a superseded attempt runs its hooks (on_llm_end after another's claim)"),
    _m("LP16", "        await _before_user_code(c)  # a superseded attempt runs no guardrail "
               "(I1)\n",
       "", "a superseded attempt runs its guardrails"),
    _m("LP19", "    if c.riding_items:\n        await c.flush_async()\n    else:\n"
               "        await c.fence_async()\n", "    await c.fence_async()\n",
       "a hook reads the Session without the publications that ride to the next flush"),
    _m("LP20", "        items = await run_history(self.controller, self.session)",
       "        items = await self.session.get_items()",
       "the model is sent the Session without what rides to the next flush"),
    # ------------------------------------------------------------- runner/attempt
    _m("AT01", "            c.claim(self.owner, lease=self.lease)\n", "",
       "a resumed attempt does not claim the run (§6.3)"),
    _m("AT03", "            if self._gated and doubtful and not verifiable:",
       "            if False:",
       "a refused resume of a stuck run records a claim every time"),
    _m("AT04", "        self._gated = False\n        try:", "        try:",
       "an operator's resolution of a call in doubt is refused before its claim"),
    _m("AT05", "        elif self.lease is not None:  # a new run held from its first attempt "
               "on: its\n",
       "        elif False:  # a new run held from its first attempt on: its\n",
       "a new run's first attempt takes no lease: another owner supersedes it at once"),
    _m("AT02", "        with contextlib.suppress(ControlError):  # the attempt's own error "
               "wins\n            await self._flush()\n", "",
       "a failed attempt drops its buffered events"),
    # ------------------------------------------------------------- runner/publish
    _m("PU01", 'elif kind == "function_call" and call_id not in answered:',
       'elif kind == "function_call":',
       "one_writer blocks on a call that has its output"),
    _m("PU02", "        limit = len(items) + 1\n        while True:",
       "        limit = len(items)\n        while True:",
       "publish reads one history item too few"),
    _m("PU17", "    limit = len(items) + 1\n    while not _staged",
       "    limit = len(items)\n    while not _staged",
       "a publication staged against the Session a runner keeps takes one item too few"),
    _m("PU03", "    await controller.flush_async()  # an effect boundary: the staged envelope "
               "is durable\n", "",
       "the Session is written before the envelope is durable"),
    _m("PU04", "        with contextlib.suppress(ControlError):  # the write's own error "
               "propagates (I6)\n            controller.publication_failed(error)\n",
       "",
       "a failed write is not reported (I6)"),
    _m("PU05", "    except asyncio.CancelledError:\n        raise\n    except Exception as error:\n"
               "        with contextlib.suppress(ControlError):  # the write's own",
       "    except BaseException as error:\n"
       "        with contextlib.suppress(ControlError):  # the write's own",
       "a cancelled write is reported as failed (it may still land)"),
    _m("PU06", '    _same_session(controller, session, "settle")\n', "",
       "settle reconciles against a Session that is not the run's"),
    _m("PU07", "decision = controller.reconcile(await run_history(controller, session, "
               "limit=limit),",
       "decision = controller.reconcile(await run_history(controller, session),",
       "settle reads the whole Session",
       equivalent="reconcile reads only the last read_limit items of what it is given"),
    _m("PU08", "    for position in range(len(tail) - 1, -1, -1):",
       "    for position in range(len(tail)):",
       "one_writer reads the tail oldest first"),
    _m("PU09", "                and writer.owner is not None and event.owner != writer.owner)",
       "                and writer.owner is not None)",
       "a worker that claims again under the same owner takes its own write over"),
    _m("PU12", "    riding = list(controller.riding_items)\n", "    riding: list[JSON] = []\n",
       "a staging reads the Session without the publications that ride to the next flush"),
    _m("PU13", "    if not many_session_writes(controller.store) and controller.riding_items:\n",
       "    if False:\n",
       "a store that takes one Session write per append is handed a second that rides"),
    _m("PU14", "    elif isinstance(store, AsyncSQLiteEventStore) and _reads_through_store(store, "
               "session):\n", "    elif False:\n",
       "a Session beside an async store is read on a thread of its own, not the store's"),
    _m("PU16", "    await _write(controller, session, items, ride=ride, after=after)",
       "    await _write(controller, session, items, ride=ride)",
       "a publication's write does not carry the tail it was staged against: it lands on a "
       "Session another writer moved"),
    _m("PU10", "        return (writer is not None and writer.lease is not None\n",
       "        return (writer is not None\n",
       "a writer that took no lease is taken over by the next claimant"),
    _m("PU11", "            or not (callable(shares) and shares(store) and "
               "takes_session_write(store))):",
       "            ):",
       "a write to a Session outside the store's transaction is taken over: a stalled writer "
       "could still land it, twice"),
    _m("PU15", "        if whole or TOO_SHORT not in refused.reason:",
       "        if whole:",
       "a publication refused for another reason reads the Session again and again"),
    # -------------------------------------------------------------- runner/remote
    _m("RE01", 'answered = {e.call_id for e in history if e.kind == "tool_result"}',
       "answered: set[str | None] = set()",
       "the listing's results are ignored on reconnect"),
    _m("RE02", "        elif phase is Phase.PUBLISHED:\n            return None\n", "",
       "a published call is handled again"),
    _m("RE03", "                if attempt < self.retries:",
       "                if attempt <= self.retries:",
       "one backoff too many after the last retry",
       equivalent="the loop ends after the last attempt either way and returns False; only "
                  "one more sleep of the backoff"),
    _m("RE04", "            await self.c.flush_async()  # an effect boundary: the result is "
               "durable first\n", "",
       "a result is posted before it is durable"),
    _m("RE05", "            except AlreadyAnswered:\n"
               "                self.c.result_posted(call_id)\n",
       "            except AlreadyAnswered:\n",
       "an already answered call is not recorded as posted"),
    _m("RE06", "            if self.c.in_doubt():\n                self.c.resume()",
       "            if False:\n                pass",
       "the executor reconnects forever around an in-doubt call"),
    _m("RE07", "if self.reconnects > self.max_reconnects:",
       "if self.reconnects > self.max_reconnects + 1:",
       "max_reconnects off by one"),
    _m("RE08", "        if self.c.phase(call_id) is Phase.COMPLETED:\n"
               "            self.c.result_posted(call_id)",
       "        self.c.result_posted(call_id)",
       "an acknowledgement of a call not completed is recorded"),
    _m("RE09", "                    result = f\"tool error: {type(error).__name__}\"\n"
               "                c.tool_completed(call_id, result)",
       "                    raise\n                c.tool_completed(call_id, result)",
       "a remote tool's exception escapes instead of becoming its result"),
    # -------------------------------------------------------------- runner/agents
    _m("AG01", 'return {"behavior": self.behavior, "message": self.message}',
       'return {"behavior": self.behavior}',
       "a recorded verdict loses its message"),
    _m("AG02", "    idempotent: bool = False\n", "    idempotent: bool = True\n",
       "tools idempotent by default: a crashed tool runs again (I11)"),
    _m("AG03", 'return Verdict("reject_content", message)', 'return Verdict("allow", message)',
       "reject_content allows"),
    _m("AG04", "            if tool.name == name:\n                return tool\n",
       "            if tool.name.startswith(name):\n                return tool\n",
       "a tool looked up by prefix"),
    # ---------------------------------------------------- adapters/openai_agents
    _m("OA01", "        if retries != 0:\n", "        if False:\n",
       "an MCP server configured to retry is carried: a lost response is sent again"),
    _m("OA28", "                run._lost[context.call_id] = error\n", "                pass\n",
       "a lost MCP response is recorded as the text the SDK made of it, never in doubt"),
    _m("OA29", "            trusted = server is not None and server.name in run._trusted_mcp\n",
       "            trusted = server is not None\n",
       "every MCP server's hints count: an untrusted hinted tool is sent again"),
    _m("OA30", "meta=with_key(meta, context.idempotency_key))", "meta=meta)",
       "a tools/call is sent without the call's idempotency key"),
    _m("OA31", "        tools.update((name, tool) for name, (tool, _) in mcp.items() "
               "if name not in tools)\n", "",
       "a response's MCP calls are unknown tools to the ledger"),
    _m("OA32", "    if unknown:\n        raise _refuse(\"trusted MCP servers\"",
       "    if False:\n        raise _refuse(\"trusted MCP servers\"",
       "a misspelt trusted MCP server name is taken silently"),
    _m("OA33", "        if c.call(call_id).call.idempotent:\n            return lost\n", "",
       "an idempotent MCP call whose response was lost is reported in doubt"),
    # ---------------------------------------------------------- adapters/_mcp
    _m("MC01", "    return error_code(error) in REFUSED_UNRUN\n", "    return True\n",
       "every MCP error is the server's answer: a closed connection is recorded as one"),
    _m("MC02", "    return any(hint is True for hint in hints)\n", "    return False\n",
       "a trusted server's read-only and idempotent hints count for nothing"),
    _m("MC03", "    merged[IDEMPOTENCY_KEY] = key\n",
       "    merged.setdefault(IDEMPOTENCY_KEY, key)\n",
       "a key already in the request's _meta is kept instead of the call's"),
    _m("OA02", "    if session.session_id != controller.session_id:\n"
               "        raise ReconcileRejected(",
       "    if False:\n        raise ReconcileRejected(",
       "a run opened on another Session runs its approved tool before anything refuses it"),
    _m("OA03", "                c.begin_tool(call_id)\n"
               "                c.tool_completed(call_id, item.get(\"output\"))\n",
       "                pass\n",
       "a call the SDK answered itself (a guardrail's rejection) stays approved and unrun: "
       "the next model call is refused and the run is stuck"),
    _m("OA04", "        self._run._final = (output,)  # accepted when written, once its "
               "guardrails passed\n",
       "        self._run._final = (output,)\n        self._run._accept_final_output()\n",
       "the final output is accepted before its output guardrails' verdict"),
    _m("OA05", "    if isinstance(error, OutputGuardrailTripwireTriggered):",
       "    if False:",
       "a tripped output guardrail does not end the run"),
    _m("OA06", "        if unknown and self._config_now.tool_not_found_behavior == "
               "\"raise_error\":",
       "        if False:",
       "a response naming a tool the agent does not have is recorded: every retry is stuck"),
    _m("OA07", "            self._take_sdk_decisions(self._state)\n",
       "            pass\n",
       "a decision taken on the SDK state is dropped: the run pauses again"),
    _m("OA08", "    return _shown(item[\"output\"])\n", "    return _shown(output)\n",
       "a result is recorded in its JSON form, not as the text the SDK sent: a resent "
       "result differs"),
    _m("OA09", "            final = _sent_error(tool, tool_call, behavior[\"message\"])",
       "            final = _sent(tool, tool_call, data.output)",
       "the raw output a redacting guardrail replaced is what the ledger keeps"),
    _m("OA10", "keep=not guarded)", "keep=True)",
       "a tool with output guardrails has its raw result recorded before they run"),
    _m("OA11", "            self.controller.handoff(agent.name)\n", "            pass\n",
       "a handoff is not recorded: the ledger never shows the agent it reached"),
    _m("OA12", "        if c.step is Step.COMPLETED:\n            output = recorded_output(",
       "        if False:\n            output = recorded_output(",
       "a completed run asked again is refused instead of answering from its ledger"),
    _m("OA13", "            ctx.run_config = self._user_config\n", "            pass\n",
       "an agent tool's nested run goes through the outer run's ledger and is refused inside"),
    _m("OA14", "            self._replaying = True  # the recorded response, not a new model "
               "call\n",
       "            self._replaying = False\n",
       "a turn resumed without its SDK state asks the model again instead of replaying"),
    _m("OA15", "                 and _written_call(item) not in run._written and not "
               "run._rewritten(item)]",
       "                 and not run._rewritten(item)]",
       "a replayed response writes its calls to the Session a second time"),
    _m("OA16", "        if self._state is not None and not self._in_turn(self._state):",
       "        if False:",
       "a state saved at an earlier turn leads the SDK back into a turn the run has left"),
    _m("OA17", "        if not batch or not run._final_checked():",
       "        if not batch:",
       "a final answer whose output guardrail failed before its verdict is written"),
    _m("OA18", "            if isinstance(tool, FunctionTool) and tool.needs_approval is not "
               "False:",
       "            if False:",
       "an agent tool whose nested agent needs approvals is accepted"),
    _m("OA19", "    if execution is not None and execution.pre_approval_tool_input_guardrails:",
       "    if False:",
       "pre-approval tool input guardrails are accepted"),
    _m("OA20", "        if call_id not in c.in_flight:\n            return verdict  # a resent",
       "        if False:\n            return verdict  # a resent",
       "a resent result's output guardrail records the call's result a second time"),
    _m("OA21", "    if isinstance(error, tool_tripwires):",
       "    if False:",
       "a tool guardrail's tripwire leaves the run live: its recorded verdict trips on every "
       "retry"),
    _m("OA22", "    if isinstance(error, InputGuardrailTripwireTriggered):",
       "    if False:",
       "a tripped input guardrail leaves the run live, stuck on its recorded verdict"),
    _m("OA23", "                 and await _enabled(t.is_enabled, self._context, agent)}",
       "                 }",
       "a disabled tool counted as known: its call is recorded and every retry is stuck"),
    _m("OA24", "            if standing is not None:", "            if False:",
       "a standing decision on the SDK state is taken: later calls start with no decision"),
    _m("OA25", "                self._state = None\n                raise standing",
       "                raise standing",
       "the refused SDK state is kept and used by the next attempt"),
    _m("OA26", "        await self._run._fence()  # a superseded attempt runs no hook (I1)\n",
       "", "a superseded attempt runs the SDK's hooks"),
    _m("OA27", "        await decide_async(c, by if by is not None else self.owner,\n"
               "                           resolving(c, call_id, output, outcome=outcome, "
               "by=by,\n                                     evidence=evidence), "
               "flush=self._flush)",
       "        await decide_async(c, by,\n"
       "                           resolving(c, call_id, output, outcome=outcome, "
       "by=by,\n                                     evidence=evidence), "
       "flush=self._flush)",
       "AgentRun.resolve_in_doubt claims the run as nobody instead of its owner"),
    # ---------------------------------------------------------- adapters/_calls
    _m("AC01", "    if needed <= left:\n", "    if True:\n",
       "a result that fits its record but not its batch is kept: its batch cannot be staged"),
    _m("AC02", "    if started + failure > room(c):", "    if False:",
       "a call the run has no room for runs, and its result is refused after the body"),
    _m("AC03", "    if \"may still be writing\" not in refused.reason:\n        return refused",
       "    if True:\n        return refused",
       "the refusal of an attempt that may still be writing does not name take_over"),
    _m("AC04", "        if not _same_json(list(new_input), last):", "        if False:",
       "a completed run answers any new input with its old output"),
    _m("AC05", "    if view.phase is Phase.AWAITING:\n        raise InvalidTransition(",
       "    if False:\n        raise InvalidTransition(",
       "a call started without a recorded decision is refused unnamed, by the step's guard",
       equivalent="begin_tool's own guard refuses the same call before its body; only the "
       "refusal's wording (which decision is missing) is lost"),
    _m("AC06", "    return output if kept else recorded\n", "    return output\n",
       "the model is sent a result the ledger did not keep"),
    _m("AC07", "        return None  # after NOT_EXECUTED the body ran again: its result is its "
               "own\n    return last.outcome\n",
       "        return None  # after NOT_EXECUTED the body ran again: its result is its "
       "own\n    return Resolution.COMPLETED\n",
       "an operator's FAILED outcome is sent as the tool's success"),
    _m("AC08", "    _rehearsed(c, owner, command)\n    c.claim(owner)\n    c.flush()\n",
       "    c.claim(owner)\n    c.flush()\n",
       "a refused resolution through a sync adapter leaves its claim recorded"),
    _m("AC09", "    _rehearsed(c, owner, command)\n    c.claim(owner)\n    await flush()\n",
       "    c.claim(owner)\n    await flush()\n",
       "a refused resolution through an async adapter leaves its claim recorded"),
    # ---------------------------------------------------------- adapters/pydantic_ai
    _m("PD01", "sent = repair_messages(messages, repair_last_response=False)",
       "sent = list(messages)",
       "the history handed to pydantic-ai unmerged: after a paused turn the written count "
       "is one too high"),
    _m("PD02", 'return CapabilityOrdering(position="outermost")',
       'return CapabilityOrdering(position="innermost")',
       "the ledger records a tool's result before an outer capability rewrites it"),
    _m("PD03", "        if not self.run._driving:\n", "        if False:\n",
       "run_stream / iter with the capability run tools no one publishes"),
    _m("PD04", "            same_history(controller, history, \"passing message_history to "
               "run()\")\n", "            pass\n",
       "a run opened with another history"),
    _m("PD05", "            return _rebuilt(cached)\n", "            return cached\n",
       "a resent result is its JSON form, not what pydantic-ai sent"),
    _m("PD06", "if kind in _ANSWERS and isinstance(message, str) and len(form) == 2:",
       "if False:",
       "a resent ModelRetry / ToolFailed becomes a plain result"),
    _m("PD07", '            form = _answer(_FAILED, _bounded(f"{type(error).__name__}: {error}"))\n'
               "            raised = error\n",
       "            interrupted(c, call_id)\n            raise\n",
       "a tool that raised is left in doubt instead of recorded as failed"),
    _m("PD08", "        limit = self._room(FAILURE_ROOM * others) // 2\n",
       "        limit = self._room(FAILURE_ROOM * others)\n",
       "a result that fits once but not twice (recorded, then written) is recorded"),
    _m("PD09", "        if runnable:\n            self._room_for(runnable)\n",
       "        pass\n",
       "a turn's calls start with no room left to record their failures"),
    _m("PD10", "            messages = await self._write_proposals(messages)\n",
       "            pass\n",
       "a response recorded and not written is never written"),
    _m("PD11", "if c.step is Step.COMPLETED and deferred_tool_results is None:",
       "if False:",
       "a completed run run again is refused instead of answering"),
    _m("PD12", '_TAKE_OVER = "LedgerRun.open(..., take_over=True), or call settle(take_over=True)"',
       '_TAKE_OVER = "take_over=True"',
       "the foreign-attempt refusal does not say to open with take_over=True"),
    _m("PD13", "form.get(\"kind\") in (_FAILED, _RETRY, _RETURN):", "False:",
       "a result that looks like a recorded answer is resent as that answer"),
    _m("PD14", "        _refuse_rewriters(agent.root_capability, run_id)\n", "",
       "an agent with a history processor is opened"),
    _m("PD15", "        await self._flush()  # an effect boundary: the start is durable before "
               "the body\n", "",
       "a tool body runs before its start is durable"),
    _m("PD16", "await settle_unsettled(c, self._history, take_over=self.take_over, how=_TAKE_OVER)",
       "await settle_unsettled(c, self._history, take_over=False, how=_TAKE_OVER)",
       "take_over=True is not passed on to the reconcile"),
    _m("PD17", "            if _timed_out(retry):\n", "            if False:\n",
       "a timed-out body is recorded as a retry, and the model pays it again"),
    _m("PD18", "        _refuse_external_toolsets(agent.toolsets, run_id)\n", "",
       "an agent with external tools is opened"),
    _m("PD19", "            recorded_output(c, new, last_input=_last_prompt(c))\n", "",
       "a completed run answers a new prompt with its old answer"),
    _m("PD20", "            self._replay = _recorded_response(c.model_output)\n",
       "            pass\n",
       "a recorded answer is not handed back to its checks after a crash"),
    _m("PD21", "            self._candidate = outputs[0] if outputs else text\n",
       "            c.model_responded((), output=outputs[0] if outputs else text)\n",
       "a final output is recorded before its checks ran"),
    _m("PD22", "                if is_async(store):\n" + _PD22_COMMENT
               + "load_async(store, run_id,\n" + " " * 64 + "buffered=buffered,\n",
       "                if isinstance(store, AsyncEventStore):\n" + _PD22_COMMENT
               + "load_async(store, run_id,\n",
       "a buffered run is reopened unbuffered"),
    _m("PD23", "        _refuse_external(run.controller, request_context.model_request_parameters\n"
               "                         .function_tools, \"model_request\")",
       "        (run.controller, request_context.model_request_parameters\n"
               "                         .function_tools, \"model_request\")",
       "a request offering a tool prepared as external pays the model"),
    _m("PD24", "        if self._replays > 1:\n", "        if False:\n",
       "a recorded answer its checks refuse is handed back forever"),
    _m("PD25", "            if settled is Resolution.FAILED:", "            if False:",
       "an operator's FAILED outcome reaches the model as the tool's success"),
    _m("PD26", "            if settled is Resolution.COMPLETED:", "            if False:",
       "an operator's JSON shaped like a recorded answer is raised as that answer"),
    _m("PD27", "        await decide_async(c, by if by is not None else self.owner,\n"
               "                           abandoning(reason, by=by), flush=self._flush)",
       "        await decide_async(c, by,\n"
       "                           abandoning(reason, by=by), flush=self._flush)",
       "LedgerRun.abandon claims the run as nobody instead of its owner"),
    # ------------------------------------------------------- adapters/anthropic
    _m("AN01", '        self.check_history(messages)\n'
               '        _refuse_in_doubt(self.controller, "create")\n',
       "        self.check_history(messages)\n",
       "create sends a request while a call is in doubt (after a crash inside a tool)"),
    _m("AN02", "            sent = failure(_TOO_LARGE.format(size=len(canonical_json(sent))))",
       "            raise",
       "a result over max_bytes leaves its call in doubt instead of recorded as failed"),
    _m("AN04", "return cast(JSON, json.loads(openapi_dumps(value)))",
       "return cast(JSON, value)",
       "a result is recorded as the tool returned it, not as the SDK sends it"),
    _m("AN05", "    return _tool_result(call_id, recorded if _blocks(recorded) else "
               "_content_of(recorded),",
       "    return recorded\n    return _tool_result(call_id, recorded if _blocks(recorded) "
       "else _content_of(recorded),",
       "an operator's resolution is sent as it is, not as a tool_result block"),
    _m("AN06", "    return cast(JSON, _build_result_event(event, blocks,\n",
       "    return recorded\n    return cast(JSON, _build_result_event(event, blocks,\n",
       "an operator's resolution is posted as it is, not as a result event"),
    _m("AN07", '    return (_field(reply, "type") == "message" and _field(reply, "role") == '
               '"assistant"\n'
               "            and _field(reply, \"stop_reason\") not in _NOT_FINAL\n"
               "            and not _tool_uses(_field(reply, \"content\")))",
       '    return _field(reply, "type") == "message"',
       "a reply asking for tools ends the conversation"),
    _m("AN08", 'if stream or not asked or asked != record["request"][:len(asked)]:',
       'if stream or not asked or asked[:1] != record["request"][:1]:',
       "a completed conversation answers any request that starts like it (a new turn too)"),
    _m("AN09", 'if _field(event, "type") in _SESSION_ENDS:',
       'if _field(event, "type") == "session.deleted":',
       "a terminated session is not seen as ended: its run never completes"),
    _m("AN10", "        _replayed(c, \"create\")\n        self.replayed = True\n",
       "        _replayed(c, \"create\")\n",
       "a recorded reply is returned without saying so"),
    _m("AN11", "        c.accept_final_output(c.model_output)\n"
               "    if c.step is Step.FINAL_OUTPUT:\n        c.complete()\n",
       "        c.accept_final_output(c.model_output)\n",
       "a run whose process died between its final output and its completion never "
       "completes"),
    _m("AN12", "                    for item in cast(Generator[Any, None, None], steps()):\n"
               "                        if not streams:\n"
               "                            answered()\n",
       "                    for item in cast(Generator[Any, None, None], steps()):\n",
       "an attached sync runner records the results its requests carried as posted only "
       "when it ends"),
    _m("AN13", "        return _session_content(value)\n", "        return value\n",
       "the session runner gets a tool's pydantic return value, which it fails on"),
    _m("AN14", "if runner._toolsets_by_family:", "if False:",
       "a runner with toolsets is attached, their members outside the ledger"),
    _m("AN15", "if existing and controller.step is not Step.COMPLETED:\n"
               "            controller.claim(owner)\n            controller.flush()",
       "if existing:\n            controller.claim(owner)\n            controller.flush()",
       "opening a completed conversation claims it, which is refused"),
    _m("AN16", "        if self.replayed:  # a session that ended: nothing to claim, open, "
               "run or post\n",
       "        if False:\n",
       "a completed session is claimed again, which is refused"),
    _m("AN17", "            if not sendable.answered and call_id not in self._idempotent:",
       "            if False:",
       "a body the session runner's timeout cancelled is answered with its timed-out text"),
    # ------------------------------------------------------ read models in run heads (§7.5)
    _m("MA36", "    return e.outcome is not Resolution.NOT_EXECUTED or e.output is None",
       "    return True", "replay accepts a NOT_EXECUTED resolution that carries an output"),
    _m("JOH2", "                        folded = True\n"
               "                        state.apply(event, dest)\n"
               '                        options["read_model"] = read_model(state)\n',
       "                        state.apply(event, dest)\n"
       '                        options["read_model"] = read_model(state)\n'
       "                        folded = True\n",
       "an interrupt between the fold and the append leaves the state ahead of its log"),
    _m("JOH3", '            "step": self.step, "action": self.action}',
       '            "step": None if journal is None else journal.state.step, '
       '"action": self.action}',
       "a failed append names the step its event would have led to"),
    _m("JOH1", "                    before = found\n"
               "                    replay_onto(before, self.events, first=self.base)\n",
       "                    before = found\n",
       "an append that did not land leaves a run loaded from a snapshot at its snapshot"),
    _m("SDH1", "    if step is not None and model is not None:\n        return step, model\n",
       "    if step is not None:\n        return step, model or ReadModel(None)\n",
       "a head given a step but no read model says nothing waits"),
    _m("SDH2", "    return model if kind == blocker else None\n", "    return model\n",
       "a head whose blocker column disagrees with its read model is trusted"),
    _m("SDH3", "    return (base + len(tail), state.step, state.session_id, read_model(state)), "
               "False",
       "    return (base + len(tail), state.step, state.session_id, ReadModel(None)), False",
       "a head folded from a snapshot says nothing waits"),
    _m("SSH1", "                    fold = self._folds[run_id] = step, model\n",
       "                    fold = step, model\n",
       "the memory store folds an unfolded head on every listing and never keeps it"),
    _m("SSH2", '    return _append_takes(store, "read_model", _KEEPS_MODELS)',
       "    return True",
       "a store subclass whose append takes no read_model is handed one"),
    _m("SQH1", '                       "UPDATE runs SET step = NULL")\n',
       '                       "SELECT 1")\n',
       "an older SQLite database keeps its heads folded with no read model: nothing waits"),
    _m("SQH2", "            model = None if step is None else kept_model(run_id, text, kind)\n",
       "            model = None if step is None else (kept_model(run_id, text, kind)\n"
       "                                                or kept_model(run_id, None, None))\n",
       "a SQLite head whose read model does not decode is shown as nothing waits"),
    _m("SQH3", "                                 (value, session, text, kind, run_id, version))",
       "                                 (value, session, None, None, run_id, version))",
       "a SQLite listing keeps the fold's step but not its read model"),
    _m("SQH4", "                          model, kind))\n",
       "                          None, None))\n",
       "a SQLite run's first append keeps no read model"),
    # ------------------------------------------------- appends in another's transaction
    _m("SQX1", "                conn.execute(\"ROLLBACK TO statemachine_append\")\n",
       "                pass\n",
       "an append refused inside another connection's transaction leaves its rows there, "
       "to be committed with it"),
    _m("SQX2", "            if not conn.in_transaction:\n                raise StorageError(\n"
               "                    f\"cannot {_APPEND}: the connection it was to share",
       "            if False:\n                raise StorageError(\n"
       "                    f\"cannot {_APPEND}: the connection it was to share",
       "an append routed to a connection with no open transaction commits on its own"),
    _m("SQX3", "            if through is not None:  # (`in_transaction_of`: what it wrote, "
               "seen)",
       "            if False:  # (`in_transaction_of`: what it wrote, seen)",
       "reads inside another's transaction miss what the run appended there: its fence "
       "finds the store behind it"),
    _m("SQX4", "    if conn.in_transaction:\n        yield conn\n        return\n"
               "    conn.execute(\"BEGIN\")",
       "    conn.execute(\"BEGIN\")",
       "a load inside another's transaction begins one more and fails"),
    _m("SQX5", "        if self.readonly or self._routed() is not None:",
       "        if self.readonly:",
       "a fold read inside another's transaction is kept through the store's own "
       "connection",
       equivalent="the fold is a cache: keeping it there waits out the busy timeout and "
                  "is dropped, the same answer later"),
    _m("SQX6", "        return (st.st_dev, st.st_ino) == self._identity.identity",
       "        return True",
       "any connection is taken for one to the store's file"),
    _m("SQX7", "        if self._routed() is None:\n"
               "            self._session_table = found\n",
       "        self._session_table = found\n",
       "a Session table seen inside another's transaction is kept as made, though that "
       "transaction may roll it back"),
    _m("PGH1", '                      f"UPDATE {runs} SET step = NULL")',
       '                      "SELECT 1")',
       "a version 4 PostgreSQL schema keeps its heads folded with no read model"),
    _m("PGH2", '                 "blocker = %(kind)s, "', '                 ""',
       "a later PostgreSQL append keeps the read model but not the blocker's kind"),
    _m("PGH3", '        "model": None if model is None else model.encode(),',
       '        "model": None,',
       "a PostgreSQL append keeps no read model text: nothing waits"),
    _m("PGH4", '        sql.heads = sql.heads.replace(" step,", " NULL::text,").replace(',
       '        sql.heads = sql.heads.replace(" step,", " step,").replace(',
       "a read-only store on a version 4 schema shows its heads as nothing waits"),
    _m("PAH1", "            model = None if step is None else kept_model(run_id, text, kind)\n"
               "            if model is None:  # unfolded, or its read model does not decode: "
               "fold it\n                version, known, session, model = await",
       "            model = None if step is None else (kept_model(run_id, text, kind)\n"
               "                or kept_model(run_id, None, None))\n"
               "            if model is None:  # unfolded, or its read model does not decode: "
               "fold it\n                version, known, session, model = await",
       "a PostgreSQL head whose read model does not decode is shown as nothing waits"),
    _m("AN18", "                        resolution(c, call_id) is Resolution.FAILED)",
       "                        False)",
       "an operator's FAILED outcome is sent as a tool_result without is_error"),
    _m("AN19", "resolution(c, event.id) is Resolution.FAILED))", "False))",
       "an operator's FAILED outcome is posted as a successful result event"),
    _m("AN20", "        decide(c, by if by is not None else self.owner, abandoning(reason, "
               "by=by))", "        decide(c, by, abandoning(reason, by=by))",
       "MessageToolLedger.abandon claims the run as nobody instead of its owner"),
    # ------------------------------------------- adapters: tool_context() and verifiers
    _m("AC10", "        with running_call(c, call_id):  # tool_context() in the body\n"
               "            output = await body()",
       "        if True:  # tool_context() in the body\n            output = await body()",
       "an async adapter's tool body runs without its call's tool_context (no key)"),
    _m("AC11", "if type(tool) is not str or (tool not in known and not any_name):",
       "if type(tool) is not str:",
       "a verifier naming no tool of the run is taken, and never asked"),
    _m("AC12", "        if tool in idempotent:\n", "        if False:\n",
       "a verifier of an idempotent tool is taken, and never asked"),
    _m("AC13", "        if not callable(verify):\n", "        if False:\n",
       "a verifier that is not callable is taken, and fails only when a call is in doubt"),
    _m("AC14", "if sync_only is not None and inspect.iscoroutinefunction(verify):",
       "if False:",
       "a sync opening takes an async verifier it cannot await"),
    _m("AC15", "    refuse_other_arguments(c, call_id, arguments)\n    if view.phase is "
               "Phase.PUBLISHED:\n        answered(c, call_id)\n        return True, "
               "view.result\n",
       "    if view.phase is Phase.PUBLISHED:\n        answered(c, call_id)\n        return "
       "True, view.result\n    refuse_other_arguments(c, call_id, arguments)\n",
       "a published call asked for again with other arguments is answered with its result"),
    _m("OA34", "flush=self._flush,\n                                verifiers=checked)",
       "flush=self._flush,\n                                verifiers={})",
       "AgentRun's attempts never ask the verifiers: a call they could settle stays in "
       "doubt"),
    _m("OA35", "{tool.name for each in _agents(agent) for tool in each.tools",
       "{tool.name for each in [agent] for tool in each.tools",
       "a verifier of a tool of an agent a handoff reaches is refused"),
    _m("PD28", "flush=self._flush,\n                                verifiers=checked)",
       "flush=self._flush,\n                                verifiers={})",
       "LedgerRun's attempts never ask the verifiers: a call they could settle stays in "
       "doubt"),
    _m("PD29", "            with running_call(c, call_id):  # tool_context() in the body\n"
               "                output = await handler(args)",
       "            if True:  # tool_context() in the body\n"
               "                output = await handler(args)",
       "a pydantic-ai tool body runs without its call's tool_context (no key)"),
    _m("PD30", "            found.update(toolset.tools)", "            found.update(())",
       "a verifier of a function tool of the agent is refused as naming no tool"),
    _m("PD31", "        self._known = None  # (read afresh by each call: another run may have "
               "written)",
       "        pass  # (read afresh by each call: another run may have written)",
       "a LedgerRun keeps the history it read in an earlier call: a completed run's answer "
       "comes with the history as it was, another run's later turn missing"),
    _m("PD32", "    if not given:\n        if c.step is Step.COMPLETED:",
       "    if False:\n        if c.step is Step.COMPLETED:",
       "a run without a history retried with no messages after it wrote some is sent only "
       "its prompt: the model asks for its calls again under new ids, and they run again"),
    _m("PD33", "                _refuse_unanswered(c, read[-TAIL_ITEMS:])\n",
       "                pass\n",
       "a new run writes onto a history whose last items hold another run's call without "
       "its result"),
    _m("PD34", "        if known is None or not riding or checks_session_tail(c.store):\n"
               "            return\n",
       "        if True:\n            return\n",
       "a flush writes the history after another writer's message, the tail never read "
       "again"),
    _m("PD35", "            await c.flush_results_async()", "            await c.fence_async()",
       "a tool's result waits through the next model request: a crash there leaves its "
       "call in doubt"),
    _m("PD36", "        _refuse_output_functions(agent.output_type, run_id, \"open\")\n", "",
       "an agent whose output type is a function with an effect opens: a crash after it "
       "ran runs it again"),
    _m("PD37", "        _refuse_output_functions(options.get(\"output_type\"), c.run_id, "
               "\"run\")\n", "",
       "an output function given to run.run goes on outside the ledger"),
    _m("PD38", "            found.append(getattr(value, \"__name__\", repr(value)))",
       "            pass",
       "a function given as the output type itself is not found"),
    _m("PD39", "        if self._running:\n", "        if False:\n",
       "two runs of one LedgerRun at once both go on: the tool runs under two ids"),
    _m("PD40", "               for kind in type(toolset).__mro__):",
       "               for kind in type(toolset).__mro__[:1]):",
       "an MCP toolset of a class of the user's own opens: a lost tools/call response is "
       "recorded as failed"),
    _m("PD41", "        _refuse_external_toolsets([self.wrapped], self.run_id, listing=True)\n",
       "",
       "a dynamic toolset returning an MCP toolset runs its tools"),
    _m("OA36", "            await c.flush_results_async()", "            await c.fence_async()",
       "a tool's result waits through the next model request: a crash there leaves its "
       "call in doubt"),
    _m("OA37", "    for each in _agents(agent):\n        _check_retries(each)\n        for server "
               "in each.mcp_servers:",
       "    for each in _agents(agent):\n        for server in each.mcp_servers:",
       "an agent tool's agent with an MCP server that retries opens: its tools/call can be "
       "sent twice inside the one body"),
    _m("OA38", "            if _may_need_approval(server):", "            if False:",
       "an agent tool's agent with an MCP server needing approval opens: the outer run "
       "pauses on a call the ledger does not know"),
    _m("OA39", "        return any(policy.values())", "        return False",
       "an MCP server needing approval for some of its tools is taken for one needing none"),
    _m("OA40", "        self._rewrites = _written_again(self.controller.events, items)\n", "",
       "a turn replayed without the SDK state writes its message and reasoning items a "
       "second time"),
    _m("OA41", "(list(completed.response.output) or done)", "(list(completed.response.output))",
       "a stream whose completed response is empty is recorded empty: its calls are "
       "refused as unknown, and the run never goes on"),
    _m("AN27", "owner=owner, verifiers=checked)", "owner=owner)",
       "the session runner's iterations never ask the verifiers"),
    _m("AN22", "            with running_call(c, call_id):  # tool_context() in the body\n"
               "                result_event",
       "            if True:  # tool_context() in the body\n                result_event",
       "a session runner's tool body runs without its call's tool_context (no key)"),
    _m("AN23", "            if checked:\n                verify_in_doubt(controller, checked)",
       "            if False:\n                verify_in_doubt(controller, checked)",
       "MessageToolLedger.open never asks the verifiers"),
    _m("AN24", "            if checked:\n                await verify_in_doubt_async(",
       "            if False:\n                await verify_in_doubt_async(",
       "MessageToolLedger.open_async never asks the verifiers"),
    _m("AN25", "            with running_call(c, call_id):  # tool_context() in the body\n"
               "                block = execute(use)",
       "            if True:  # tool_context() in the body\n                block = execute(use)",
       "a messages ledger's sync tool body runs without its call's tool_context"),
    _m("AN28", "        self.controller.flush_results()\n        try:\n"
               "            reply = resource.create(**params)",
       "        try:\n            reply = resource.create(**params)",
       "a superseded messages ledger still asks the model (no fence before the request), "
       "the results it carries not durable first"),
    _m("AN26", "            with running_call(c, call_id):  # tool_context() in the body\n"
               "                block = await execute(use)",
       "            if True:  # tool_context() in the body\n"
               "                block = await execute(use)",
       "a messages ledger's async tool body runs without its call's tool_context"),
    _m("AN29", 'if any(_field(block, "type") in _THINKING', 'if any(_field(block, "type") in ()',
       "a reply with thinking blocks is rebuilt for a history that lacks it (the ledger "
       "keeps no signatures)"),
    _m("AN30", "            missing = _missing(c, resumed)\n", "            missing = []\n",
       "a history lacking two turns is sent with the first one only: the model asks again"),
    _m("AN31", "                c.flush_results()\n", "                c.fence()\n",
       "an attached sync runner's request waits for the model with the results it carries "
       "unflushed: a crash then leaves their calls in doubt"),
    _m("AN32", "                await c.flush_results_async()  # the results it carries",
       "                await c.fence_async()  # the results it carries",
       "an attached async runner's request waits for the model with the results it "
       "carries unflushed: a crash then leaves their calls in doubt"),
    _m("AN33", "        self._keep_turn(messages, reply)\n        if self._after_reply(messages, "
               "reply):\n            self.controller.flush()",
       "        if self._after_reply(messages, reply):\n            self.controller.flush()",
       "a create loop's replies are not kept: a retry from an older history is refused, "
       "the run left to an operator"),
    _m("AN34", "            self._goes_on(messages)  # (its messages may have been set)\n"
               "            self._keep_sent(messages)\n",
       "            self._goes_on(messages)  # (its messages may have been set)\n",
       "a tool runner's replies are not kept: a retry from an older history is refused, the "
       "run left to an operator"),
    _m("AN35", "        self._goes_on(messages)\n        self.check_history(messages)",
       "        self.check_history(messages)",
       "a request that does not go on from the history is sent: the end would write after "
       "it a conversation the model never had"),
    _m("AN36", "                c._journal.stop(InvalidTransition, reason)\n", "",
       "an end whose staging failed leaves the final answer buffered: the next flush lands "
       "it without its conversation"),
    _m("AN37", "        return [*self._goes_on(messages),\n"
               "                _message({\"role\": \"assistant\", \"content\": "
               "_field(reply, \"content\")})]",
       "        return self._goes_on(messages)",
       "the history is written without the final reply"),
    _m("AN38", "    elif not buffered:\n", "    elif False:\n",
       "a per-event run keeps a history: its staging lands apart from the commit"),
    _m("AN39", "            self._goes_on(messages)  # (its messages may have been set)\n"
               "            self._keep_sent(messages)\n",
       "            self._keep_sent(messages)\n",
       "a tool runner's messages are checked against the history before its first "
       "request only: messages set later end in a conversation the model never had"),
    _m("AN40", "        block.pop(\"cache_control\", None)\n", "",
       "a prompt cache mark is kept in the history: moving the breakpoint is refused"),
    _m("AN41", "                and not journal.unflushed):", "                and True):",
       "ledger.messages holds a conversation whose end was refused and never landed"),
    _m("AN42", "            if size + STAGED_BYTES <= left:\n                return added",
       "            if True:\n                return added",
       "messages the log has no room for are sent: the end, once the model answered, can "
       "never complete"),
    _m("AN43", "            runner.compact_before_next_turn = refuse_compaction  # type: "
               "ignore[method-assign]\n", "",
       "a tool runner with a history compacts: the end writes a summary as the conversation"),
    _m("AN44", "            if (getattr(runner, \"_pending_compaction\", None) is not None\n",
       "            if (False\n",
       "a runner that scheduled a compaction before it was attached compacts: with an empty "
       "history the summary is written as the conversation"),
    _m("AN45", "            self._posted(compacted[0])\n", "",
       "the results a compaction request carried are never posted: the run never completes"),
    _m("AN48", "            if _compacting(runner):\n                return\n"
               "            self._posted(sent[0])",
       "            self._posted(sent[0])",
       "the results a compaction carried are posted before a request built on its summary "
       "is answered: a retry from the first message after that request failed runs the "
       "tool again"),
    _m("AN46", "                if _compacting(runner) and self._end_before_compaction(\n",
       "                if False and self._end_before_compaction(\n",
       "a compaction after the final reply is sent before the run's end is recorded: the "
       "sync runner's conversation is left unrecorded"),
    _m("AN47", "        return last is not None and _final(last) and self._after_reply("
               "messages, last)",
       "        return False",
       "a compaction after the final reply leaves the run at tools once the runner ends "
       "(the last message is the compaction's)"),
    _m("AN49", "        if params.get(\"stream\"):\n            # a stream is answered whole",
       "        if False:\n            # a stream is answered whole",
       "create posts the results a streamed request carries when its stream opens: broken "
       "mid-body, a retry from the first message goes out as it was and the tool runs twice"),
    _m("AN50", "        if params.get(\"stream\"):  # answered whole only once read to its end",
       "        if False:  # answered whole only once read to its end",
       "acreate posts a streamed request's results when its stream opens (AN49, async)"),
    _m("AN51", "        streams = isinstance(runner, BetaStreamingToolRunner | "
               "BetaAsyncStreamingToolRunner)",
       "        streams = False",
       "a streamed runner's results are posted when the stream opens: broken mid-body, a "
       "retry from the first message runs the tool twice"),
    _m("AN52", "            _refuse_abandoned(c, \"create\")\n            return None",
       "            return None",
       "create and a runner's first request go out on a run this ledger abandoned"),
    _m("AN53", "            _refuse_abandoned(c, \"create\")  # (abandoned while the runner "
               "went on)",
       "            pass",
       "a runner abandoned between two requests sends the next one"),
    # ------------------------------------------------------------------- langgraph
    _m("LG01", "                c.flush()  # an effect boundary: the start is durable before "
               "the body\n",
       "                pass  # an effect boundary: the start is durable before the body\n",
       "a LangGraph call's start is not flushed before its body runs"),
    _m("LG02", "        c, call_id, call, answer = self._before(request)\n"
               "        if answer is not None:\n            return answer\n        try:\n"
               "            with running_call(c, call_id):\n"
               "                result = handler(request)",
       "        c, call_id, call, answer = self._before(request)\n        try:\n"
       "            with running_call(c, call_id):\n                result = handler(request)",
       "wrap_tool_call drops the ledger's answer: a completed, published or rejected call "
       "runs its body again"),
    _m("LG03", "                c.reject(call_id, message if isinstance(message, str) else "
               "REJECTED,\n                         fingerprint=fingerprint)",
       "                c.approve(call_id, fingerprint=fingerprint)",
       "a review's reject is recorded as an approval: the rejected call runs"),
    _m("LG04", "                with contextlib.suppress(ControlError):\n"
               "                    c.flush()\n                return error",
       "                return error",
       "the error a LangGraph body raised is recorded but never flushed: the next process "
       "finds the call in doubt"),
    _m("LG05", "            if made.get(\"fingerprint\") != c.fingerprint(call_id):",
       "            if False:",
       "a review decision's fingerprint is never compared: a stale approval binds to other "
       "arguments"),
    _m("LG06", "            if new.needs_approval and old in approved and old not in edits:",
       "            if new.needs_approval:",
       "an edit's re-proposed calls are all approved, the edited one with them: it runs "
       "without its own approval"),
    _m("LG07", "        if latest is not None and parent != latest:", "        if False:",
       "OneWriterSaver never checks the parent: two resumers of one checkpoint both write"),
    _m("LG08", "                    conn.execute(\"BEGIN IMMEDIATE\")  # the write lock, until "
               "the commit",
       "                    pass  # the write lock, until the commit",
       "OneWriterSaver on SqliteSaver takes no write lock: another process writes between "
       "the check and the put"),
    _m("LG09", "        c.publication_committed()\n        c.flush()\n        return result",
       "        c.flush()\n        return result",
       "a checkpoint write that carried a batch's results never commits its publication"),
    _m("LG10", "            if together is None:\n"
               "                c.flush()  # the envelope is durable before the write\n",
       "",
       "the publication staged for a checkpoint write is not flushed before the write"),
    _m("LG11", "        if \"|\" in str(configurable.get(\"checkpoint_ns\") or \"\"):  # a task "
               "of a subgraph",
       "        if False:  # a task of a subgraph",
       "a tool node inside a subgraph is not refused"),
    _m("LG12", "        self.verifiers = checked_verifiers(verifiers, named, "
               "idempotent=idempotent,\n                                           "
               "run_id=run_id, sync_only=\"a sync verifier\")",
       "        checked_verifiers(verifiers, named, idempotent=idempotent,\n"
       "                          run_id=run_id, sync_only=\"a sync verifier\")\n"
       "        self.verifiers = {}",
       "the ToolLedger checks its verifiers, then never asks them: a call they could settle "
       "stays in doubt"),
    _m("LG13", "            with running_call(c, call_id):\n                result = "
               "handler(request)",
       "            if True:\n                result = handler(request)",
       "a LangGraph sync tool body runs without its call's tool_context (no key)"),
    _m("LG14", "                c.flush()  # the result is durable before LangGraph "
               "checkpoints it",
       "                pass  # the result is durable before LangGraph checkpoints it",
       "a LangGraph call's result is not flushed before LangGraph checkpoints it"),
    _m("LG15", "    if node._handle_tool_errors is not False:  # the ledger's refusals pass "
               "through it",
       "    if False:  # the ledger's refusals pass through it",
       "tool_node lets handle_tool_errors turn the ledger's refusals (a call in doubt) into "
       "a tool message the model can answer by calling again"),
    _m("LG16", "        async with self._async_lock():  # the check and the write, one step",
       "        if True:  # the check and the write, one step",
       "OneWriterSaver.aput checks the parent and writes with no lock between: two async "
       "resumers in one process both write"),
    _m("LG17", "                if not batch:\n                    raise UnsupportedFeature(",
       "                if False:\n                    raise UnsupportedFeature(",
       "a Send of a call no AIMessage holds is entered as an empty batch instead of refused"),
    _m("LG18", "            if c.in_doubt():\n                # as a process loading the run",
       "            if False:\n                # as a process loading the run",
       "a ledger held by the process runs a reply's new calls beside a call in doubt"),
    _m("LG19", "        self._in_step(request)\n",
       "",
       "a sync tool call runs before LangGraph's write of its step's checkpoint ended: a "
       "resumer whose write OneWriterSaver refused runs its tools"),
    _m("LG20", "    claim_at_open = False", "    claim_at_open = True",
       "a resumer that finds nothing to record supersedes the resumer that goes on: of two, "
       "neither goes on"),
    _m("LG21", "        if planned:\n            c.flush()  # decisions are durable before",
       "        if True:\n            c.flush()  # decisions are durable before",
       "a resumer that finds the decisions recorded appends its claim alone: it supersedes "
       "the resumer that recorded them, and of two neither goes on"),
    _m("LG22", "                self._enter(c, batch, flush=False)\n",
       "                self._enter(c, batch)\n",
       "a new batch is flushed on its own before its first start: two writes before the "
       "body where one does"),
    _m("LG23", "                if entered:  # the batch durable all the same, as a caller "
               "sees it\n",
       "                if False:\n",
       "a batch entered for a call whose start is refused stays buffered: a call awaiting "
       "approval is not durable for the operator to decide"),
    _m("LG24", "            if named:\n", "            if False:\n",
       "check_step asks whether a checkpoint is written and is told the thread's latest: a "
       "step whose checkpoint was never written is said to be moved past"),
    _m("LG25", "            if c.step is not Step.UNSETTLED and not any(\n",
       "            if True or not any(\n",
       "a checkpoint carrying a tool's result is written without its publication"),
    _m("LG26", "            if c.step is not Step.UNSETTLED and not any(\n",
       "            if False and not any(\n",
       "every checkpoint write of a graph with publications reads and decodes the whole "
       "parent checkpoint"),
    _m("LG27", "        if self._sqlite() is None:\n            found = saver.get_tuple(config)",
       "        if True:\n            found = saver.get_tuple(config)",
       "the one-writer check on SqliteSaver reads and decodes a whole checkpoint, six times "
       "a turn"),
    _m("LG28", "        held = ledger._lock if self._together and ledger is not None else "
               "contextlib.nullcontext()",
       "        held = contextlib.nullcontext()",
       "in one file with the ledger, a put takes the file's write lock before the ledger's "
       "lock: a ledger call on another thread waiting for the file deadlocks it"),
    _m("LG29", "            written = self._put_held(*args)",
       "            written = saver.put(*args)",
       "the checkpoint that publishes commits on its own, before its publication's commit"),
    _m("LG30", "            written = self._put_held(*args)\n"
               "            c.publication_committed()\n",
       "            written = self._put_held(*args)\n",
       "a checkpoint written with its publication never commits the publication"),
    _m("LG31", "            if threading.get_ident() != me:\n",
       "            if False:\n",
       "another thread's read during the held put runs without the saver's lock and sees "
       "the checkpoint before its commit"),
    _m("LG32", "        self._together = (ledger is not None and conn is not None\n",
       "        self._together = False and (ledger is not None and conn is not None\n",
       "the ledger in the checkpoints' file is not noticed: the staging waits for the "
       "put's own write lock"),
    _m("LG33", "                with self.ledger.store.in_transaction_of(conn, saver.lock) "
               "as routed:\n",
       "                with contextlib.nullcontext(set()) as routed:\n",
       "the ledger's calls during a put in one file go through the store's own connection, "
       "which waits for the put's write lock"),
    _m("LG34", "                    except BaseException:\n"
               "                        self._drop(routed)\n",
       "                    except BaseException:\n",
       "a copy of the run left ahead of a rolled-back write is kept: another attempt "
       "appending as many events passes its fence"),
    _m("LG35", "        kept = vars(saver).get(\"cursor\")",
       "        kept = None",
       "a cursor the user set on the saver is dropped by a checkpoint that publishes"),
    _m("LG36", "        self._lock = self._locks.write\n",
       "        self._lock = threading.Lock()\n",
       "two OneWriterSavers around one SqliteSaver write on its connection at once: one's "
       "BEGIN IMMEDIATE meets the other's open transaction"),
    _m("LG37", "            lock = self._locks.loops.get(loop)\n",
       "            lock = None\n",
       "each async put gets a lock of its own: two resumers through one saver both check "
       "before either writes"),
    _m("LG38", "                    self._ended(config, checkpoint, error)  # a step waiting "
               "hears it now\n",
       "                    pass\n",
       "a put that cannot take the file's write lock never says how it ended: the step "
       "waits out its timeout and is refused, the write's own error lost"),
    # ------------------------------------------------------------------ google-adk
    _m("LG39", "                    refuse_other_arguments(c, call_id, _arguments(call))\n",
       "", "a call id asked for again with other arguments is answered with its result"),
    _m("GA01", "                c.flush()  # an effect boundary: the start is durable before "
               "the body\n",
       "                pass  # an effect boundary: the start is durable before the body\n",
       "an ADK call's start is not flushed before its body runs"),
    _m("GA02", "                answered(c, call_id)\n                return self._answering(\n"
               "                    run_id, call_id, self._answer(c, call_id, "
               "long_running=long_running))",
       "                answered(c, call_id)\n                return None",
       "before_tool_callback lets a completed, published or rejected call through to its "
       "body"),
    _m("GA03", "            answered(c, call_id)  # answered with its rejection, never run\n"
               "            return {\"error\": REJECTED}",
       "            answered(c, call_id)  # answered with its rejection, never run\n"
               "            return None",
       "a confirmation that rejects is recorded, then the call runs anyway",
       equivalent="ADK's own confirmation gate (apply_confirmation_gate, after the plugin's "
                  "before_tool_callback) answers a rejected confirmation with the same "
                  "{'error': REJECTED} before the body, and refuses a confirmation for a "
                  "call whose tool no longer requires one: the body never runs either way"),
    _m("GA04", "    if shown not in (fingerprint, None) or (given.confirmed",
       "    if False and (given.confirmed",
       "a confirmation's fingerprint is never compared: one shown for another call "
       "confirms this one"),
    _m("GA05", " or (given.confirmed and shown != fingerprint):",
       " or False:",
       "a confirmation that shows no fingerprint is accepted as an approval"),
    _m("GA06", "        if recorded and (recorded[-1] == \"approved\") != "
               "bool(given.confirmed):",
       "        if False:",
       "a confirmation contradicting the ledger's decision (the operator's) is not refused"),
    _m("GA07", "                if theirs != ours and not any(e.id == event.id for e in "
               "stored.events):",
       "                if False:",
       "OneWriterSessionService never checks the session's last event: two writers both "
       "append"),
    _m("GA08", "        c.flush()  # the results (and their envelope) are durable before the "
               "write\n        return bool(answered)",
       "        return bool(answered)",
       "the publication staged for a session append (the results riding with it) is not "
       "flushed before the append"),
    _m("GA09", "        with plugin._lock:\n            c.publication_committed()\n"
               "            c.flush()\n        return written",
       "        with plugin._lock:\n            c.flush()\n        return written",
       "a session append that carried a batch's responses never commits its publication"),
    _m("GA10", "        if c.step is Step.UNSETTLED:\n"
               "            await self._reconcile(c, invocation_context.session,",
       "        if False:\n            await self._reconcile(c, invocation_context.session,",
       "a run left unsettled by a failed session append is never reconciled when it opens"),
    _m("GA11", "        if _mcp(toolset):\n            raise "
               "UnsupportedFeature(\n                f\"{kind} is not carried",
       "        if False:\n            raise UnsupportedFeature(\n"
       "                f\"{kind} is not carried",
       "an MCP toolset is not refused when the run opens"),
    _m("GA12", "        if agent.sub_agents:", "        if False:",
       "an agent with sub-agents is not refused when the run opens"),
    _m("GA13", "        self.verifiers = checked_verifiers(verifiers, named, "
               "idempotent=idempotent,\n                                           "
               "sync_only=\"a sync verifier\")",
       "        checked_verifiers(verifiers, named, idempotent=idempotent,\n"
       "                          sync_only=\"a sync verifier\")\n"
       "        self.verifiers = {}",
       "the LedgerPlugin checks its verifiers, then never asks them: a call they could "
       "settle stays in doubt"),
    _m("GA14", "            self._bodies[(run_id, call_id)] = entered(context_of(c, call_id))",
       "            pass",
       "an ADK tool body runs without its call's tool_context (no key)"),
    _m("GA15", "then finds the call\n                c.flush()  # completed",
       "then finds the call\n                pass  # completed",
       "an ADK call's result is not flushed when recorded: a crash before ADK's append "
       "leaves a call that ran in doubt"),
    _m("GA16", "            brought = {**_confirmations(tool_context.session, c), call_id: given}",
       "            brought = {call_id: given}",
       "only a call's own confirmation is recorded: the first confirmed call of a message "
       "to start moves the run on, and its sibling's confirmation is refused"),
    _m("GA17", "    except StaleSessionError as stale:",
       "    except () as stale:",
       "the session service's own stale-session refusal reaches the caller as ADK's "
       "StaleSessionError, not ConcurrencyConflict"),
    _m("GA18", "            if c.in_doubt() and c is held:  # a body this process ran was "
               "interrupted:\n                self.forget(run_id)",
       "            if False:\n                self.forget(run_id)",
       "a call whose body this process saw cancelled is refused at its tool callback, "
       "not when the invocation opens: ADK records the refusal's error event, and the "
       "invocation never goes on once the call is settled"),
    _m("GA19", "                tool_context.actions.skip_summarization = True\n",
       "                pass\n",
       "the ledger's confirmation pause is not marked as ADK's gate marks it: in an app "
       "that is not resumable the model is asked again at the pause"),
    _m("GA20", "            if c is not None:\n                c.flush_results()",
       "            if False:\n                c.flush_results()",
       "the model request is not fenced: a superseded attempt asks the model"),
    _m("GA21", "            except ConcurrencyConflict:  # superseded: the copy stays "
               "held, and refuses\n                raise  # (the session service fences",
       "            except ValueError:  # superseded: the copy stays "
       "held, and refuses\n                raise  # (the session service fences",
       "a superseded attempt whose result's flush is refused drops its copy of the run: "
       "ADK writes its error event unfenced"),
    _m("GA22", "            error.add_note(_SETTLING_WRITE)",
       "            pass",
       "the error of the ledger's own reconciling write reaches run_async's caller inside "
       "ADK's RuntimeError"),
    _m("GA23", "            if getattr(event, \"author\", None) == \"user\":  # it opens an "
               "invocation",
       "            if False:  # it opens an invocation",
       "a user's message is written before an unsettled append is reconciled: the run can "
       "never settle"),
    _m("GA24", "        if isinstance(tool, SetModelResponseTool):",
       "        if False:",
       "ADK's own set_model_response goes through the ledger's callbacks like a tool"),
    _m("GA25", "            if c is not None:\n                self._stage(c, event, "
               "[_event_json(e) for e in session.events])",
       "            if False:\n                self._stage(c, event, "
       "[_event_json(e) for e in session.events])",
       "the plugin stages nothing before ADK hands the event to the session service: the "
       "results it carries are not durable when a kill comes before the service writes"),
    _m("GA26", "                c.flush()  # the invocation ends awaiting it: durable (the "
               "inbox lists it)",
       "                pass  # the invocation ends awaiting it: durable (the inbox lists it)",
       "a confirmation is asked for while the call awaiting it is not durable: the "
       "operator's inbox shows nothing"),
    _m("GA27", "                if c.holds_attempt:\n                    with contextlib."
               "suppress(ControlError):\n                        c.publication_failed(error)",
       "                if False:\n                    with contextlib."
       "suppress(ControlError):\n                        c.publication_failed(error)",
       "a staged event whose append is refused before anything was written leaves its "
       "attempt open, not recorded failed"),
    _m("GA28", "        if agent.code_executor is not None:", "        if False:",
       "an agent's code executor is not refused when the run opens: the model's code runs "
       "outside the ledger"),
    _m("GA29", "                if own is not getattr(BasePlugin, name):",
       "                if False:",
       "a plugin before the ledger that answers tool results is not refused: a body's "
       "result can bypass the ledger, its call left in doubt"),
    _m("GA30", "supersedes no live attempt.\"\"\"\n        await self._refuse(invocation_context)",
       "supersedes no live attempt.\"\"\"\n        return None",
       "what the adapter cannot carry is refused only at before_run_callback: the user's "
       "message is written and the run claimed first, superseding a live attempt"),
    _m("GA31", "        with self._lock:\n            kept, recorded = record_result("
               "c, call_id, plain(used, fallback=_as_text))",
       "        with self._lock:\n            kept, recorded = record_result("
       "c, call_id, plain(result, fallback=_as_text))",
       "the ledger keeps the body's raw output, not what the agent's callback made of it: "
       "a resend differs from what the model was given, and a masked value is kept"),
    _m("GA32", "                return result  # the ledger's word, already what ADK made",
       "                return None  # the ledger's word, already what ADK made",
       "a call answered from the ledger goes through the agent's after-tool callback "
       "again: it runs twice, on what it already made"),
    _m("GA33", "                 if run == run_id]",
       "                 ]",
       "an error escaping one run settles the errors another run's bodies raised too: "
       "a call whose error callback then declines is left started, in doubt"),
    _m("GA34", "            self._raised[(c.run_id, call_id)] = error\n        return None",
       "            self._raised[(c.run_id, call_id)] = error\n"
       "        return await self._rest_of_chain(\n"
       "            \"on_tool_error_callback\", tool=tool, tool_args=tool_args,\n"
       "            tool_context=tool_context, error=error)",
       "the plugin runs ADK's error chain after it itself (as before): a chain that "
       "answers nothing runs twice"),
    _m("GA35", "        elif name == \"after_tool_callback\":\n"
               "            used = options[\"result\"]",
       "        elif name == \"after_tool_callback\":\n            used = {}",
       "a call of a tool the agent lacks, answered by a before-tool callback after the "
       "ledger, is recorded with nothing: a resend differs from what the model was given"),
    _m("GA36", "            used = build_tool_not_found_response(tool.name, tools)",
       "            used = {\"error\": f\"no tool {tool.name}\"}",
       "a call of a tool the agent lacks is recorded with a text of the ledger's, not "
       "ADK's not-found response the model was given"),
    _m("GA37", "                kept, recorded = record_result(c, call_id, plain(used, "
               "fallback=_as_text))\n                try:\n                    c.flush()\n"
               "                except ConcurrencyConflict:\n                    raise\n"
               "                except BaseException:  # nothing of it durable",
       "                kept, recorded = record_result(c, call_id, plain(used, "
       "fallback=_as_text))\n                try:\n                    pass\n"
       "                except ConcurrencyConflict:\n                    raise\n"
       "                except BaseException:  # nothing of it durable",
       "the answer to a call of a tool the agent lacks is not made durable before ADK "
       "uses it: a crash right after ADK appends it leaves the ledger without the call "
       "the session answered"),
    _m("GA38", "            if not self._unsettled(run_id):\n                return\n",
       "",
       "a user's message claims the run (the claim flushed alone) before its write decides "
       "between two resumers: the loser supersedes the winner, and neither goes on"),
    _m("GA39", "    \"ORDER BY timestamp DESC, rowid DESC LIMIT 1)\")",
       "    \"ORDER BY timestamp DESC LIMIT 1)\")",
       "the last stored event is read without ADK's order for events of the same time: "
       "another writer's event stamped with the copy's last time goes unseen, and the "
       "stale copy writes over it"),
    _m("GA40", "            if last == (session.events[-1].id if session.events else None):",
       "            if True:",
       "a session copy another writer moved past is taken for the stored session"),
    _m("GA41", "            self.path = str(service._db_connect_path)",
       "            self.path = None",
       "every append's check loads the whole session through ADK (about 2 ms, four "
       "times a turn)"),
    _m("GA42", "                and all(getattr(type(service), name, None)\n"
               "                        is getattr(SqliteSessionService, name) for name in "
               "self._READS_AS_ADK)\n",
       "",
       "a subclass's own get_session is bypassed by the check: its answer is not the one "
       "that counts"),
    _m("GA43", '    _READS_AS_ADK = ("get_session", "_get_db_connection", "_resolve_session_id")',
       '    _READS_AS_ADK = ("get_session",)',
       "a subclass that reads its sessions from another file, or maps their ids, is read "
       "by the check as ADK's own file and ids"),
    _m("GA44", "                if self._conn is None or self._file != file:\n",
       "                if self._conn is None:\n",
       "the check keeps reading the sessions file it first opened after the path names "
       "another (a restored file): a stale copy writes over the other writer's event"),
    _m("GA45", "connect_readonly(where, timeout=0.0, immutable=False)",
       "connect_readonly(where, timeout=5.0, immutable=False)",
       "the check waits on the event loop for another connection's lock: every session "
       "the loop runs stalls"),
    _m("GA46", "        if plugin is not None and _same_file(service, plugin.store):\n",
       "        if False:\n",
       "ADK's session service on the ledger's file is carried until its first event's "
       "write fails inside ADK"),
    # ------------------------------------------------------------------ telemetry
    _m("GA47", "    return any(\"Mcp\" in kind.__name__ or \"MCP\" in kind.__name__ for kind in "
               "type(obj).__mro__)",
       "    return \"Mcp\" in type(obj).__name__ or \"MCP\" in type(obj).__name__",
       "an MCP tool or toolset of a class of the user's own (no Mcp in its name) opens: "
       "its call can reach the server twice"),
    _m("GA48", "                refuse_other_arguments(c, call_id, _arguments(tool_args))\n",
       "", "a call id asked for again with other arguments is answered with its result"),
    _m("TE01", "    span = None if spans is None or not switch.telemetry else "
               "spans.calls.get(call_id)",
       "    span = None",
       "a tool body runs outside its execute_tool span (its own spans are not nested)"),
    _m("TE02", "    if outcome == \"refused_in_doubt\":\n        _failed(span, \"ToolInDoubt\")",
       "    if False:\n        _failed(span, \"ToolInDoubt\")",
       "a call refused in doubt is not marked as an error"),
    _m("TE03", "    error = getattr(event, \"error\", None)",
       "    error = getattr(event, \"output\", None)",
       "a payload (a result, an output) becomes an attribute"),
    _m("TE04", "            _failed(span, \"interrupted\")\n            span.end()",
       "            _failed(span, \"interrupted\")",
       "an interrupted call's span never ends (never exported)"),
    _m("TE05", "            case ev.PublicationCommitted() if self.publication is not None:",
       "            case ev.PublicationCommitted() if False:",
       "a committed publication's span never ends with its outcome"),
    _m("TE06", "            if current.is_recording():",
       "            if False:",
       "transitions inside the SDK's or the runner's span get a record span each instead"),

)
