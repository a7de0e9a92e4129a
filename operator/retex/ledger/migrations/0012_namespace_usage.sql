-- What each namespace keeps in the shared ledger, for its quota (the operator's
-- RETEX_NAMESPACE_MAX_TASKS and RETEX_NAMESPACE_MAX_RESULT_BYTES): its tasks not yet purged,
-- whatever their phase (a Task deleted from Kubernetes keeps its row until history retention
-- purges it), and the bytes of their steps' results. The triggers below keep it in the
-- transaction of every write that changes it (a task inserted, a result written, a task purged),
-- so admission reads one row, not the namespace's rows; the insert's update locks that row until
-- the admission commits, so two admissions never both take a namespace's last place.
-- No CHECK that the counts stay at or above 0: were they ever to drift, a failing purge (which
-- lowers them) would stop history retention itself.
CREATE TABLE retex.namespace_usage (
    namespace     text PRIMARY KEY,
    tasks         bigint NOT NULL DEFAULT 0,
    result_bytes  bigint NOT NULL DEFAULT 0
);

-- A result's size as the CHECK on retex.steps.result measures it. A JSON null (a step that returns
-- nothing: most) counts 0, so committing it leaves the namespace's row alone: commits of one
-- namespace wait for each other on that row only when they store something.
CREATE FUNCTION retex.stored_result_bytes(result jsonb) RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN result IS NULL OR jsonb_typeof(result) = 'null' THEN 0 ELSE octet_length(result::text) END
$$;

CREATE FUNCTION retex.usage_task_in() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO retex.namespace_usage AS usage (namespace, tasks) VALUES (NEW.namespace, 1)
        ON CONFLICT (namespace) DO UPDATE SET tasks = usage.tasks + 1;
    RETURN NULL;
END $$;
CREATE TRIGGER tasks_usage_in AFTER INSERT ON retex.tasks
    FOR EACH ROW EXECUTE FUNCTION retex.usage_task_in();

-- BEFORE the delete: the task's steps, which the cascade deletes, are still there to be counted.
CREATE FUNCTION retex.usage_task_out() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE retex.namespace_usage SET tasks = tasks - 1, result_bytes = result_bytes -
        (SELECT coalesce(sum(retex.stored_result_bytes(result)), 0) FROM retex.steps WHERE task_uid = OLD.uid)
        WHERE namespace = OLD.namespace;
    RETURN OLD;
END $$;
CREATE TRIGGER tasks_usage_out BEFORE DELETE ON retex.tasks
    FOR EACH ROW EXECUTE FUNCTION retex.usage_task_out();

-- Every writer of a result: a worker's commit, a human's resolve, a recovery from a Task's status.
CREATE FUNCTION retex.usage_result() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    change bigint := retex.stored_result_bytes(NEW.result)
        - CASE WHEN TG_OP = 'UPDATE' THEN retex.stored_result_bytes(OLD.result) ELSE 0 END;
BEGIN
    IF change <> 0 THEN
        UPDATE retex.namespace_usage SET result_bytes = result_bytes + change
            WHERE namespace = (SELECT namespace FROM retex.tasks WHERE uid = NEW.task_uid);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER steps_usage AFTER INSERT OR UPDATE OF result ON retex.steps
    FOR EACH ROW EXECUTE FUNCTION retex.usage_result();

-- What the ledger holds already. After the triggers: creating them locked both tables against
-- writes until this transaction commits, so no write falls between this count and the triggers.
INSERT INTO retex.namespace_usage (namespace, tasks, result_bytes)
SELECT t.namespace, count(*), coalesce(sum(s.bytes), 0)
FROM retex.tasks t
LEFT JOIN (SELECT task_uid, sum(retex.stored_result_bytes(result)) AS bytes FROM retex.steps GROUP BY task_uid) s
    ON s.task_uid = t.uid
GROUP BY t.namespace;
