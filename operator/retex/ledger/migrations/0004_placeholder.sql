-- Placeholder so that 0005 applies on this branch (migrations are numbered without gaps).
-- Another branch adds the real 0004: at merge, this file is deleted in favour of that one.
SELECT 1;
